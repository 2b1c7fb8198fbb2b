"""Derive the op bounds of thresholds.py from the reference kernels' own error, and print the table.

    python -m flashnext.conformance.calibrate --backend cpu --seeds 0 1 2 [--report h200.json ...] [--json out.json]

Runs the suite's op cases (every declared precision, every KV cache dtype) against `--backend` for each seed, adds
the cases of any earlier conformance reports (`--report`: e.g. one made on an accelerator), and prints per op and
bound column: the largest NMSE observed, the bound the rule gives, the bound in force, and what a 0.5% systematic
scale error costs under it. The rule: bound = the next 1-2-5 value at or above 3 x the largest error observed, never
below FLOOR (fp32 reductions in another order differ by more than our two kernels do); exact ops stay 0.
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from flashnext.conformance.thresholds import THRESHOLDS

OPS = ("embedding", "rmsnorm", "add_rmsnorm", "rope", "store_kv", "attention", "linear", "silu_and_mul")
HEADROOM = 3.0
FLOOR = {"fp32": 1e-10}
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
            " or ".join(OPS),
        ]
        subprocess.run(cmd, check=False, capture_output=True)
        return json.loads(report.read_text())["cases"]


def observed(cases: list[dict]) -> dict[tuple[str, str], float]:
    """Largest NMSE per (op, bound column) among passed or failed cases with a number."""
    worst: dict[tuple[str, str], float] = defaultdict(float)
    for c in cases:
        op = c["name"].split("[")[0]
        if op == "linear_fp8_activation_range":
            op = "linear"
        value = c.get("value")
        if op in OPS and c.get("metric") == "nmse" and isinstance(value, float) and math.isfinite(value):
            column = c.get("bound_as") or c["precision"]
            worst[op, column] = max(worst[op, column], value)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", default=[], help="backend to measure (repeatable)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--report", type=Path, action="append", default=[], help="earlier conformance JSON reports")
    parser.add_argument("--json", type=Path, help="write the table here")
    args = parser.parse_args()
    cases = [c for b in args.backend for seed in args.seeds for c in run_suite(b, seed)]
    for path in args.report:
        cases += json.loads(path.read_text())["cases"]
    rows = []
    print(f"{'op':14} {'column':9} {'observed':>9} {'rule':>9} {'bound':>9} {'0.5% fault / bound':>19}")
    for (op, column), value in sorted(observed(cases).items()):
        rule = max(ceil_125(HEADROOM * value), FLOOR.get(column, 0.0)) if value > 0 else 0.0
        bound = THRESHOLDS[op].limit(column)
        margin = SCALE_FAULT / bound if bound > 0 else math.inf
        rows.append({"op": op, "column": column, "observed": value, "rule": rule, "bound": bound})
        print(f"{op:14} {column:9} {value:9.2e} {rule:9.2e} {bound:9.2e} {margin:19.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
