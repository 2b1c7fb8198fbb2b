"""pytest plugin (entry point `pytest11`): picks the backend under test, records each case, writes the reports.

Inert in ordinary test runs: it adds options, and reports only on tests that use the suite's `conformance` fixture
(a `Recorder`; the fixtures live in suite.py so they never leak into other projects' tests). A test whose recorded
case fails is reported as failed with the case's message, so one test may check several things without stopping at
the first.
"""

import json
import math
from dataclasses import asdict, dataclass

import pytest

from .thresholds import THRESHOLDS

_BACKEND = pytest.StashKey[object]()
_ITEM_CASES = pytest.StashKey[list]()


@dataclass
class CaseResult:
    name: str
    backend: str
    precision: str
    metric: str
    threshold: float | None
    value: float | None
    passed: bool | None  # None: skipped
    message: str = ""
    outcome: str = ""  # passed | failed | skipped
    nodeid: str = ""
    bound_as: str = ""  # the column of the threshold table that applied (an op's activation dtype)

    @classmethod
    def from_json(cls, d: dict) -> "CaseResult":
        return cls(**{k: float(v) if k in ("threshold", "value") and isinstance(v, str) else v for k, v in d.items()})

    def as_json(self) -> dict:
        d = asdict(self)
        for key in ("threshold", "value"):
            if isinstance(d[key], float) and not math.isfinite(d[key]):
                d[key] = str(d[key])  # JSON has no NaN/Inf literals
        return d


def pytest_addoption(parser):
    group = parser.getgroup("flashnext", "flashnext conformance")
    group.addoption(
        "--flashnext-backend",
        default=None,
        metavar="NAME",
        help="Backend the conformance suite checks (default: FLASHNEXT_BACKEND, else auto).",
    )
    group.addoption(
        "--flashnext-json",
        default=None,
        metavar="PATH",
        help="Write the conformance report (one entry per case) as JSON.",
    )
    group.addoption(
        "--flashnext-seed",
        default=0,
        type=int,
        metavar="N",
        help="Seed of the random inputs (reported, so a failure can be replayed).",
    )


def pytest_configure(config):
    _COLLECTED.clear()
    config.addinivalue_line("markers", "slow: end-to-end conformance cases on the default model")


def backend_under_test(config):
    """The selected Backend, resolved once per run through the same discovery users get."""
    if _BACKEND not in config.stash:
        import os

        from flashnext.core import registry
        from flashnext.core.errors import UserError

        name = config.getoption("--flashnext-backend") or os.environ.get("FLASHNEXT_BACKEND") or "auto"
        try:
            config.stash[_BACKEND] = registry.select(registry.discover(), name).backend
        except UserError as exc:
            raise pytest.UsageError(str(exc)) from None
    return config.stash[_BACKEND]


class Recorder:
    """What a test calls to record a case: a named metric, its value and the bound it must meet."""

    def __init__(self, item, backend_name: str):
        self.item, self.backend_name = item, backend_name
        self.cases: list[CaseResult] = item.stash.setdefault(_ITEM_CASES, [])

    def _name(self, label: str) -> str:
        base = self.item.name.removeprefix("test_")
        return f"{base}::{label}" if label else base

    def check(
        self,
        key: str,
        precision: str,
        value: float,
        label: str = "",
        detail: str = "",
        fault: str | None = None,
        bound_as: str | None = None,
    ) -> bool:
        """Compare `value` with THRESHOLDS[key] for `precision` (or for `bound_as`: the dtype an op without weights
        computes in); a `fault` fails the case whatever the value."""
        b = THRESHOLDS[key]
        limit = b.limit(bound_as or precision)
        passed = fault is None and b.passes(value, bound_as or precision)
        message = ""
        if not passed:
            sign = ">" if b.at_most else "<"
            message = fault or f"{b.metric} {value:.3g} {sign} {limit:g}"
            message = f"{self._name(label)} [{self.backend_name}, {precision}]: {key} {message}"
            message += f"; {detail}" if detail else ""
        self.cases.append(
            CaseResult(
                self._name(label),
                self.backend_name,
                precision,
                b.metric,
                limit,
                float(value),
                passed,
                message,
                nodeid=self.item.nodeid,
                bound_as=bound_as or precision,
            )
        )
        return passed

    def expect(self, ok: bool, precision: str, label: str, message: str) -> bool:
        """A yes/no case (metric 'holds', threshold 1): e.g. an undeclared precision must be refused."""
        name = self._name(label)
        text = "" if ok else f"{name} [{self.backend_name}, {precision}]: {message}"
        self.cases.append(
            CaseResult(
                name, self.backend_name, precision, "holds", 1.0, 1.0 if ok else 0.0, ok, text, nodeid=self.item.nodeid
            )
        )
        return ok


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    cases = item.stash.get(_ITEM_CASES, [])
    if report.when == "call" and report.passed and any(c.passed is False for c in cases):
        report.outcome = "failed"
        report.longrepr = "\n".join(c.message for c in cases if c.passed is False)
    for c in cases:
        report.user_properties.append((c.name, f"{c.metric}={c.value:.4g} bound={c.threshold:g} passed={c.passed}"))
    in_suite = "conformance" in getattr(item, "fixturenames", ())  # ordinary test runs stay untouched
    if in_suite and (report.when == "call" or (report.when == "setup" and not report.passed)):
        # On the report itself (plain JSON), so that pytest-xdist carries the cases from its workers to the
        # controller, which writes the one complete report.
        report.flashnext_cases = [c.as_json() for c in _cases_of(item, report, call, cases)]
    return report


def pytest_runtest_logreport(report):
    _COLLECTED.extend(CaseResult.from_json(c) for c in getattr(report, "flashnext_cases", ()))


_COLLECTED: list[CaseResult] = []  # this run's cases, gathered where the reports arrive (the xdist controller)


def _cases_of(item, report, call, cases: list[CaseResult]) -> list[CaseResult]:
    for c in cases:
        c.outcome = "passed" if c.passed else "failed"
    crashed = report.failed and not any(c.passed is False for c in cases)
    if cases and not report.skipped and not crashed:
        return cases
    # The test itself is the case: a skip with its reason, or an exception no recorded case explains.
    backend = item.config.stash.get(_BACKEND, None)
    precision = getattr(item, "callspec", None) and item.callspec.params.get("precision", "")
    message = ""
    if report.skipped:
        message = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    elif report.failed:
        message = f"{item.name.removeprefix('test_')}: {_error_line(call, report)}"
    passed = None if report.skipped else report.passed
    return cases + [
        CaseResult(
            item.name.removeprefix("test_"),
            getattr(backend, "name", "?"),
            precision or "",
            "error" if report.failed else "ran",
            None,
            None,
            passed,
            message,
            report.outcome,
            item.nodeid,
        )
    ]


def _error_line(call, report) -> str:
    exc = call.excinfo.value if call.excinfo else None
    if isinstance(exc, ModuleNotFoundError) and exc.name:  # an optional package the case needs: say which
        return f"this case needs the '{exc.name}' package: pip install {exc.name}"
    return call.excinfo.exconly() if call.excinfo else report.longreprtext.strip().splitlines()[-1]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    results: list[CaseResult] = list(_COLLECTED)
    if not results or hasattr(config, "workerinput"):  # an xdist worker: the controller reports
        return
    profile = _profile_under_test(config)
    path = config.getoption("--flashnext-json")
    if path:
        doc = {
            "backend": results[0].backend,
            "profile": profile.name,
            "executed_on": profile.executed_on(),
            "seed": config.getoption("--flashnext-seed"),
            "passed": sum(r.passed is True for r in results),
            "failed": sum(r.passed is False for r in results),
            "skipped": sum(r.passed is None for r in results),
            "cases": [r.as_json() for r in results],
        }
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
    _print_table(results, profile)


def _profile_under_test(config):
    """The profile the engine-level cases ran (harness.make_engine)."""
    from .harness import profile_under_test

    return profile_under_test(backend_under_test(config))


def _print_table(results: list[CaseResult], profile) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="flashnext conformance", show_lines=False)
    for col in ("case", "precision", "metric", "value", "bound", "result"):
        table.add_column(col, overflow="fold")
    order = {False: 0, None: 1, True: 2}
    for r in sorted(results, key=lambda r: order[r.passed]):
        verdict = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "[yellow]skip[/]"}[r.passed]
        value = "" if r.value is None else f"{r.value:.3g}"
        bound = "" if r.threshold is None else f"{r.threshold:g}"
        table.add_row(escape(r.name), r.precision, r.metric, value, bound, verdict)
    console = Console()
    if not console.is_terminal:
        console = Console(width=150)  # CI logs: wide enough that case names stay on one line
    console.print(table)
    failed = [r for r in results if r.passed is False]
    for r in failed:
        console.print(f"[red]FAIL[/] {escape(r.message)}", highlight=False)
    console.print(
        f"{sum(r.passed is True for r in results)} cases passed, {len(failed)} failed, "
        f"{sum(r.passed is None for r in results)} skipped; engine cases ran on {escape(profile.executed_on())} "
        f"(profile '{escape(profile.name)}')",
        highlight=False,
    )
