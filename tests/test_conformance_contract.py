"""The plugin contract the conformance suite relies on: declarations honoured, allowlist names, a stripped install,
complete reports under xdist, the FP8 format table, the calibrated bounds and the step-by-step invariant judge."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conformance_helpers import env_with, listed
from flashnext.conformance import harness
from flashnext.conformance.calibrate import FLOOR, ceil_125, earlier, margin_rows, margin_rule, op_rows, rule
from flashnext.conformance.checks import compare
from flashnext.conformance.formats import FP8_FORMATS
from flashnext.conformance.suite import _stored_weight_problem, gain_fault
from flashnext.conformance.thresholds import CLEAR_MARGIN, THRESHOLDS
from flashnext.core.backend import StoredWeight
from flashnext.core.cli_conformance import _run_pytest
from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.errors import UserError
from flashnext.plugins.cpu import CpuBackend

DOCS = Path(__file__).parent.parent / "docs"
PLUGINS = Path(__file__).parent / "broken_plugins"


class NoPrefixCacheBackend(CpuBackend):
    name = "no-prefix-cache"
    features = CpuBackend.features | {"prefix_caching": False}


def test_prefix_caching_declared_off_is_off():
    tiny = harness.tiny_model()
    engine = harness.make_engine(NoPrefixCacheBackend(), tiny, "fp32", **harness.plain_profile(), prefix_caching=True)
    assert not engine.profile.prefix_caching and not engine.blocks.prefix_caching
    shared = harness.tiny_prompts(1, 2, lengths=(48,))[0]
    seqs = [harness.run_requests(engine, [shared + [t]], SamplingParams(max_tokens=2))[0] for t in (3, 4)]
    assert [s.num_cached_prefix for s in seqs] == [0, 0]
    on = harness.make_engine(CpuBackend(), tiny, "fp32", **harness.plain_profile(), prefix_caching=True)
    assert on.blocks.prefix_caching  # declared on stays on


def test_allowlist_takes_entry_point_or_distribution_names(tmp_path):
    info = tmp_path / "flashnext_broken_rope-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flashnext-broken-rope\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[flashnext.backends]\nbroken-rope = flashnext_broken_rope\n")
    paths = [tmp_path, PLUGINS]
    shown = listed(env_with(paths))["broken-rope"]
    assert shown["entry_point"] == "broken-rope" and shown["origin"] == "flashnext-broken-rope 0.1"
    assert "broken-rope" in listed(env_with(paths, FLASHNEXT_PLUGINS="flashnext-broken-rope"))
    assert "broken-rope" not in listed(env_with(paths, FLASHNEXT_PLUGINS="something-else"))


def test_missing_pytest_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "pytest", None)  # as after `pip install torch==2.13.0 -e .` without it
    with pytest.raises(UserError) as err:
        _run_pytest("cpu", None, None, None)
    assert "pip install pytest" in str(err.value) and "\n" not in str(err.value)


def test_json_report_is_complete_under_xdist(tmp_path):
    pytest.importorskip("xdist")
    suite = Path(harness.__file__).with_name("suite.py")
    report = tmp_path / "r.json"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(suite),
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(tmp_path),
        "-c",
        "/dev/null",
        "-n",
        "2",
        "--flashnext-backend",
        "cpu",
        "-k",
        "rope and (fp32 or bf16)",
        "--flashnext-json",
        str(report),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env_with([]), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:]
    doc = json.loads(report.read_text())
    assert doc["backend"] == "cpu" and len(doc["cases"]) == 16 and doc["passed"] == 16  # 4 shapes x 2 x (q, k)
    assert len({c["nodeid"] for c in doc["cases"]}) == 8


def test_fp8_format_table_matches_torch():
    for dtype, fmt in FP8_FORMATS.items():
        values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        assert {i for i in range(256) if values[i].isnan()} == fmt.nan_bytes, dtype
        assert {i for i in range(256) if values[i].isinf()} == fmt.inf_bytes, dtype
        finite = values[torch.isfinite(values)]
        assert float(finite.max()) == fmt.max and float(finite[finite > 0].min()) == fmt.smallest_subnormal


def test_op_bounds_and_greedy_margins_follow_the_calibration():
    table = json.loads((DOCS / "conformance_calibration.json").read_text())
    assert table["ops"] and table["e2e_clear_margin"], "run conformance/calibrate.py (docs/conformance.md)"
    for row in table["ops"]:
        assert THRESHOLDS[row["op"]].limit(row["column"]) >= row["rule"], row
        assert row["rule"] == rule(max(row["observed"].values()), FLOOR.get(row["column"], 0.0)), row
    assert {r["precision"] for r in table["e2e_clear_margin"]} == set(CLEAR_MARGIN)
    by_source = {}
    for row in table["e2e_clear_margin"]:
        for source, value in row["observed"].items():
            by_source.setdefault(source, {})[row["precision"]] = value
    for row in table["e2e_clear_margin"]:
        p = row["precision"]
        assert CLEAR_MARGIN[p] >= row["rule"] == max(margin_rule(p, s) for s in by_source.values() if p in s), row
    # The one column no kernel here can show rounding for: bounded by the rule, not by a guess.
    e5m2 = next(r for r in table["ops"] if (r["op"], r["column"]) == ("linear", "fp8-e5m2"))
    assert THRESHOLDS["linear"].limit("fp8-e5m2") == e5m2["rule"]
    assert ceil_125(2.1e-6) == 5e-6 and ceil_125(1e-5) == 1e-5 and ceil_125(0) == 0


def test_calibration_keeps_each_source_apart(tmp_path):
    """A table written on another machine folds in as its own sources, beside this machine's."""
    other = {
        "ops": [{"op": "linear", "column": "fp8-e5m2", "observed": {"cuda": 3e-4}, "rule": 1e-3, "bound": 0.02}],
        "e2e_clear_margin": [{"precision": "bf16", "observed": {"cuda": 0.4}, "rule": 2.0, "margin": 1.0}],
    }
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(other))
    ops, margins = earlier(path)
    rows = op_rows({"cpu": {("linear", "fp8-e5m2"): 8e-6}} | ops)
    assert rows[0]["observed"] == {"cpu": 8e-6, "cuda": 3e-4} and rows[0]["rule"] == 1e-3
    rows = margin_rows({"cpu": {"bf16": 0.1}} | margins)
    assert rows[0]["observed"] == {"cpu": 0.1, "cuda": 0.4} and rows[0]["rule"] == 1.0  # sqrt(3) x 0.4 -> 1
    assert margin_rule("int4", {"int4": 0.05, "bf16": 0.78}) == 2.0  # bf16 activations' drop added


@pytest.mark.parametrize("shape", [(33, 1536), (7, 320)])
def test_half_a_percent_scale_fails_where_nmse_cannot_see_it(shape):
    """Under bf16 rounding (and W8A8-like noise), a 0.5% gain is caught by the gain check, never an exact scale."""
    ref = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    noisy = ref + torch.randn(*shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.03
    for out in (ref.bfloat16().double(), noisy):
        assert gain_fault(compare(out, ref), "bf16") is None
        assert "systematic scale error" in gain_fault(compare(out * 1.005, ref), "bf16")


class _Tape:
    def __init__(self, rows):
        self.rows = rows

    def get(self, seq, step):
        return self.rows.get((seq.request_id, step))


class _Seq:
    def __init__(self, rid, out):
        self.request_id, self.output_ids = rid, out


def test_divergence_tells_near_ties_from_faults():
    tie, clear = torch.tensor([5.0, 4.999, 0.0]), torch.tensor([5.0, 2.0, 0.0])
    nudged = tie + torch.tensor([0.0, 0.002, 0.0])
    plain = [_Seq("b", [0, 2])]
    # a near tie flipped by a logit difference larger than its margin: rounding, not a fault
    worst, fault, *_ = harness.divergence(
        _Tape({("a", 0): nudged}), [_Seq("a", [1, 0])], _Tape({("b", 0): tie}), plain, limit=1e-3
    )
    assert fault is None and worst < 1e-3
    # the same token change with a clear margin and nearly equal logits: the token is not its logits' argmax
    _, fault, *_ = harness.divergence(
        _Tape({("a", 0): clear + 1e-4}), [_Seq("a", [1, 0])], _Tape({("b", 0): clear}), plain, limit=1e-3
    )
    assert fault and "not the one its logits pick" in fault
    # NaN logits are named as such
    _, fault, *_ = harness.divergence(
        _Tape({("a", 0): clear * float("nan")}), [_Seq("a", [0, 2])], _Tape({("b", 0): clear}), plain, limit=1e-3
    )
    assert fault and "non-finite logits" in fault
    # logits far apart: the value exceeds the bound, and the step is named
    worst, fault, where, *_ = harness.divergence(
        _Tape({("a", 0): clear * 1.1}), [_Seq("a", [0, 2])], _Tape({("b", 0): clear}), plain, limit=1e-3
    )
    assert fault is None and worst > 1e-3 and "request 0 step 0" in where


class _Reports:
    """A backend's stored_weights answer, handed in."""

    def __init__(self, **stored):
        self.stored = stored

    def stored_weights(self, model):
        return self.stored


def test_grid_storage_check_accepts_exact_values_and_names_what_is_not():
    from flashnext.core.precision import PRECISIONS, int4_quantize

    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 256, generator=g) * 0.05
    for symmetric in (True, False):
        grid = int4_quantize(w, 64, symmetric).dequantize(torch.float32)
        assert _stored_weight_problem(_Reports(**{"layer 0 o": StoredWeight(grid, "grid", 64)}), None, "int4") is None
    grid = int4_quantize(w, 64).dequantize(torch.float32)
    kept = _Reports(**{"layer 0 o": StoredWeight(w, "grid", 64)})  # full precision claimed as int4
    assert "lie on no 16-level grid: the weights are not int4" in _stored_weight_problem(kept, None, "int4")
    wider = grid.clone()
    wider[3, :64] = torch.linspace(-1, 1, 64)  # evenly spaced, but 64 levels
    message = _stored_weight_problem(_Reports(**{"layer 2 down": StoredWeight(wider, "grid", 64)}), None, "int4")
    assert message.startswith("layer 2 down: values of row 3, columns 0..63")
    assert "group_size dividing K=256" in _stored_weight_problem(
        _Reports(**{"layer 0 o": StoredWeight(grid, "grid", 96)}), None, "int4"
    )
    half = PRECISIONS["fp16"].quantize(w).float()
    assert _stored_weight_problem(_Reports(**{"layer 0 o": StoredWeight(half, "grid")}), None, "fp16") is None
    assert "values are not torch.float16 values" in _stored_weight_problem(
        _Reports(**{"layer 0 o": StoredWeight(w, "grid")}), None, "fp16"
    )
    assert "Backend.stored_weights" in _stored_weight_problem(_Reports(), None, "int4")
    native = _Reports(**{"layer 0 o": StoredWeight(grid)})  # dense floats claimed as native int4
    assert _stored_weight_problem(native, None, "int4") == "layer 0 o is stored as Tensor, not Int4Weight"


def test_op_tape_names_the_first_op_call_where_two_runs_part():
    from flashnext.conformance.suite import _tapes
    from flashnext.plugins.cpu.kernels import CpuKernels

    class OffKernels(CpuKernels):
        def silu_and_mul(self, x):
            return super().silu_and_mul(x) * 1.01

    class OffBackend(CpuBackend):
        def kernels(self, precision):
            return OffKernels()

    tiny, prompts = harness.tiny_model(), harness.tiny_prompts(2, 3)
    runs = []
    for backend in (CpuBackend(), OffBackend()):
        engine = harness.make_engine(backend, tiny, "fp32", **harness.plain_profile())
        tapes = _tapes(engine)
        runs.append((harness.run_requests(engine, prompts, SamplingParams(max_tokens=3, ignore_eos=True)), tapes[1]))
    (seqs, ops), (off_seqs, off_ops) = runs
    assert ops.order[:4] == [
        "000 layer 0 embedding",
        "001 layer 0 rmsnorm",
        "002 layer 0 linear (qkv)",
        "003 layer 0 rope (q)",
    ]
    assert ops.ops["002 layer 0 linear (qkv)"] == "linear" and ops.order[-3:] == [
        "024 final add_rmsnorm (normed)",
        "025 final add_rmsnorm (residual)",
        "026 lm head linear",
    ]
    blame = harness.first_op_divergence(off_ops, off_seqs[1], ops, seqs[1], 2, lambda op: 1e-10)
    assert blame.startswith("first divergence at layer 0 silu_and_mul, normalized error 0.0001 (its op bound 1e-10)")
    assert f"over the {len(prompts[1]) + 2} tokens" in blame
    same = harness.first_op_divergence(ops, seqs[0], ops, seqs[0], 2, lambda op: 1e-10)
    assert same.startswith("every op call agrees between the runs within its op bound")
