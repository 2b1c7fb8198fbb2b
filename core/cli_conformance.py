"""`flashnext conformance`: the shared conformance suite against one installed backend (flags: DESIGN.md)."""

import importlib.util
import os
from pathlib import Path
from typing import Annotated

import typer

from .errors import FlashnextError, UserError
from .threads import HELP as threads_help


def conformance(
    backend: Annotated[
        str, typer.Option(envvar="FLASHNEXT_BACKEND", help="Backend to check: a name or auto.")
    ] = "auto",
    junit: Annotated[Path | None, typer.Option("--junit", help="Write JUnit XML here.")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the JSON report here.")] = None,
    select: Annotated[str | None, typer.Option("-k", help="Only cases matching this pytest -k expression.")] = None,
    threads: Annotated[int | None, typer.Option(min=1, help=threads_help)] = None,
):
    """Check a backend's kernels, precisions and engine invariants against the reference; exit 1 on any failure."""
    from . import registry
    from .threads import apply_setting

    apply_setting(threads)

    entry = registry.select(registry.discover(), backend)  # unknown or unavailable: one line, exit 2
    for path in (junit, json_path):
        if path is not None and not path.parent.is_dir():
            raise UserError(f"{path}: the folder {path.parent} does not exist; create it or pick another path")
    code = _run_pytest(entry.name, junit, json_path, select)
    if code == 5:
        raise UserError(f"no conformance case matches -k {select!r}; case names look like 'rope', 'linear', 'e2e'")
    if code not in (0, 1):
        raise FlashnextError(f"pytest could not run the conformance suite (exit {code}); rerun with --debug")
    raise typer.Exit(code)


def _run_pytest(backend: str, junit: Path | None, json_path: Path | None, select: str | None) -> int:
    try:
        import pytest
    except ModuleNotFoundError as exc:  # a stripped install: name what to add, no traceback
        raise UserError(f"flashnext conformance needs the '{exc.name}' package: pip install {exc.name}") from None

    suite = importlib.util.find_spec("flashnext.conformance.suite").origin
    # Our own rootdir and an empty ini file: the user's project config and conftest files must not change the cases.
    args = [
        suite,
        "--rootdir",
        str(Path(suite).parent),
        "-c",
        os.devnull,
        "-p",
        "no:cacheprovider",
        "--import-mode=importlib",
        "-o",
        "junit_family=xunit1",
        "-q",
        "-rN",
        "--flashnext-backend",
        backend,
    ]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        args += ["-p", "flashnext.conformance.pytest_plugin"]
    if junit is not None:
        args += ["--junitxml", str(junit)]
    if json_path is not None:
        args += ["--flashnext-json", str(json_path)]
    if select:
        args += ["-k", select]
    return int(pytest.main(args))
