"""Derive the conformance bounds from the reference kernels' own error, and print the table.

    python -m flashnext.conformance.calibrate --backend cpu --seeds 0 1 2 --e2e [--report h200.json ...]
        [--source cuda-h200=calibration_h200.json ...] [--json out.json]

Op bounds: runs the suite's op cases (every declared precision, every KV cache dtype) against `--backend` for each
seed, adds the cases of earlier conformance reports (`--report`: e.g. one made on an accelerator), and prints per op
and bound column: the largest NMSE observed, the bound the rule gives, the bound in force, and what a 0.5% systematic
scale error costs under it. The rule: bound = the next 1-2-5 value at or above 3 x the largest error observed, never
below FLOOR (fp32 reductions in another order differ by more than our two kernels do); exact ops stay 0.

End-to-end greedy margins (`--e2e`): on the default model, teacher-forced over the CPU's greedy tokens on the greedy
prompts and over the Shakespeare passage, how far each precision of `--backend` moves the lead of the CPU fp32 top
token over its nearest competitors (the CPU fp32 top COMPETITORS; the fp32 column: the core reference kernels
against the CPU's). A step counts for `e2e_greedy_agreement` when its fp32 top-2 margin exceeds
thresholds.CLEAR_MARGIN. The rule: the op rule's 3 x in NMSE is sqrt(3) x in logits (an amplitude), rounded up to
1-2-5, at least MARGIN_FLOOR; the int4 and fp8 columns assume bf16 activations (as the op table does) while the
CPU runs them in fp32, so bf16's drop is added to theirs.

Every observation is kept per source (a backend run here, a report, or `--source FILE`: the observations of a
calibration JSON written on another machine, under their own source names), so that a run on another device adds
its column to the table. `--seeds` with no value measures no op case (e.g. `--e2e` alone on top of `--source`).
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from flashnext.conformance.thresholds import CLEAR_MARGIN, THRESHOLDS

OPS = ("embedding", "rmsnorm", "add_rmsnorm", "rope", "store_kv", "attention", "linear", "silu_and_mul")
# Cases judged by an op's bound under another name.
SAME_BOUND = {"linear_fp8_activation_range": "linear", "fp8_linear_edges": "linear"}
HEADROOM = 3.0
FLOOR = {"fp32": 1e-10}
MARGIN_FLOOR = 0.01  # logits: summation order alone moves a 135M model's logits by about 1e-4
COMPETITORS = 5  # the tokens that could overtake the top one: a lead of tens of logits is no competitor
SCALE_FAULT = 0.005**2  # NMSE a 0.5% systematic scale error adds: (1.005 - 1)^2


def ceil_125(x: float) -> float:
    """The smallest value of the 1, 2, 5 x 10^k series at or above x."""
    if x <= 0:
        return 0.0
    exp = math.floor(math.log10(x))
    for step in (1, 2, 5, 10):
        value = float(f"{step}e{exp}")  # exact decimal, not 5 * 10**-6 = 4.9999999999999996e-06
        if value >= x * (1 - 1e-9):
            return value
    raise AssertionError


def rule(observed: float, floor: float = 0.0) -> float:
    return max(ceil_125(HEADROOM * observed), floor) if observed > 0 else 0.0


def run_suite(backend: str, seed: int) -> list[dict]:
    suite = Path(__file__).with_name("suite.py")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "ops.json"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            str(suite),
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            tmp,
            "-c",
            "/dev/null",
            "--flashnext-backend",
            backend,
            "--flashnext-seed",
            str(seed),
            "--flashnext-json",
            str(report),
            "-k",
            " or ".join(OPS + tuple(SAME_BOUND)),
        ]
        subprocess.run(cmd, check=False, capture_output=True)
        return json.loads(report.read_text())["cases"]


def observed(cases: list[dict]) -> dict[tuple[str, str], float]:
    """Largest NMSE per (op, bound column) among passed or failed cases with a number."""
    worst: dict[tuple[str, str], float] = defaultdict(float)
    for c in cases:
        op = c["name"].split("[")[0]
        op = SAME_BOUND.get(op, op)
        value = c.get("value")
        if op in OPS and c.get("metric") == "nmse" and isinstance(value, float) and math.isfinite(value):
            column = c.get("bound_as") or c["precision"]
            worst[op, column] = max(worst[op, column], value)
    return worst


def margin_shifts(backend_name: str) -> dict[str, float]:
    """Per precision of the backend: the largest drop, over the default model's teacher-forced steps, of the CPU
    fp32 top token's lead over each of its next COMPETITORS - 1 tokens when `backend_name` computes the logits."""
    from flashnext.conformance import harness
    from flashnext.conformance.data import GREEDY_PROMPTS, SHAKESPEARE
    from flashnext.core import registry
    from flashnext.core.engine.sequence import SamplingParams
    from flashnext.core.loader import load_model

    model = load_model(None)
    entries = registry.discover()
    backend, cpu = (registry.select(entries, name).backend for name in (backend_name, "cpu"))
    settings = dict(
        harness.plain_profile(),
        max_model_len=1024,
        max_num_batched_tokens=1024,
        kv_cache_max_gib=0.25,
        prefix_caching=False,
    )
    reference = harness.make_engine(cpu, model, "fp32", **settings)
    prompts = [model.tokenizer.encode(t) for t in GREEDY_PROMPTS]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    outs = harness.outputs(harness.run_requests(reference, prompts, params))
    texts = [q + out for q, out in zip(prompts, outs)] + [model.tokenizer.encode(SHAKESPEARE)]
    want = [harness.prompt_logits(reference, ids).double() for ids in texts]
    shifts = {}
    for precision in backend.precisions:
        under_test = harness.ReferenceBackend() if backend is cpu and precision == "fp32" else backend
        engine = harness.make_engine(under_test, model, precision, **settings)
        worst = 0.0
        for ids, ref in zip(texts, want):
            mine = harness.prompt_logits(engine, ids).double()
            top = ref.topk(COMPETITORS, dim=-1).indices  # [rows, k]: the top token, then its competitors
            lead_ref = ref.gather(1, top[:, :1]) - ref.gather(1, top[:, 1:])
            lead_mine = mine.gather(1, top[:, :1]) - mine.gather(1, top[:, 1:])
            worst = max(worst, float((lead_ref - lead_mine).amax()))
        shifts[precision] = worst
    return shifts


def _by_source(sources: dict[str, dict[tuple[str, str], float]]) -> dict[tuple[str, str], dict[str, float]]:
    table: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for source, worst in sources.items():
        for key, value in worst.items():
            table[key][source] = value
    return table


def op_rows(sources: dict[str, dict[tuple[str, str], float]]) -> list[dict]:
    rows = []
    print(f"{'op':14} {'column':9} {'observed':>9} {'rule':>9} {'bound':>9} {'0.5% fault / bound':>19}  sources")
    for (op, column), seen in sorted(_by_source(sources).items()):
        value = max(seen.values())
        bound = THRESHOLDS[op].limit(column)
        margin = SCALE_FAULT / bound if bound > 0 else math.inf
        row = {"op": op, "column": column, "observed": seen, "rule": rule(value, FLOOR.get(column, 0.0))}
        rows.append(row | {"bound": bound})
        print(f"{op:14} {column:9} {value:9.2e} {row['rule']:9.2e} {bound:9.2e} {margin:19.1f}  {', '.join(seen)}")
    return rows


# The activation dtype a precision's column assumes, where the reference kernels compute in another (fp32).
ASSUMED_ACTIVATIONS = {"fp8-e4m3": "bf16", "fp8-e5m2": "bf16", "int4": "bf16"}


def margin_rule(precision: str, shifts: dict[str, float]) -> float:
    """CLEAR_MARGIN's rule for one source's largest lead drops by precision."""
    value = shifts[precision] + shifts.get(ASSUMED_ACTIVATIONS.get(precision, ""), 0.0)
    return max(ceil_125(math.sqrt(HEADROOM) * value), MARGIN_FLOOR)


def margin_rows(sources: dict[str, dict[str, float]]) -> list[dict]:
    rows = []
    print(f"\n{'precision':9} {'largest lead drop':>17} {'rule':>6} {'CLEAR_MARGIN':>12}  sources")
    merged = _by_source({s: {(p, ""): v for p, v in shifts.items()} for s, shifts in sources.items()})
    for (precision, _), seen in sorted(merged.items()):
        value = max(seen.values())
        rules = [margin_rule(precision, shifts) for shifts in sources.values() if precision in shifts]
        row = {"precision": precision, "observed": seen, "rule": max(rules)}
        rows.append(row | {"margin": CLEAR_MARGIN[precision]})
        print(f"{precision:9} {value:17.3g} {row['rule']:6g} {CLEAR_MARGIN[precision]:12g}  {', '.join(seen)}")
    return rows


def earlier(path: Path) -> tuple[dict, dict]:
    """The per-source observations of a calibration JSON: (ops, margins)."""
    table = json.loads(path.read_text())
    ops, margins = defaultdict(dict), defaultdict(dict)
    for row in table.get("ops", []):
        for source, value in row["observed"].items():
            ops[source][row["op"], row["column"]] = value
    for row in table.get("e2e_clear_margin", []):
        for source, value in row["observed"].items():
            margins[source][row["precision"]] = value
    return ops, margins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", default=[], help="backend to measure (repeatable)")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--e2e", action="store_true", help="also measure the end-to-end greedy margins")
    parser.add_argument("--report", type=Path, action="append", default=[], help="earlier conformance JSON reports")
    parser.add_argument(
        "--source", type=Path, action="append", default=[], help="the observations of another calibration JSON"
    )
    parser.add_argument("--json", type=Path, help="write the table here")
    args = parser.parse_args()
    ops: dict[str, dict] = {}
    margins: dict[str, dict] = {}
    for path in args.source:  # measured here again, a source is replaced below
        more_ops, more_margins = earlier(path)
        ops |= more_ops
        margins |= more_margins
    for path in args.report:
        report = json.loads(path.read_text())
        ops[f"{report['backend']} ({path.name})"] = observed(report["cases"])
    for b in args.backend:
        if args.seeds:
            ops[b] = observed([c for seed in args.seeds for c in run_suite(b, seed)])
        if args.e2e:
            margins[b] = margin_shifts(b)
    table = {"ops": op_rows(ops), "e2e_clear_margin": margin_rows(margins) if margins else []}
    if args.json:
        args.json.write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main()
