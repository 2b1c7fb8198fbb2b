"""The conformance suite must catch real faults: each broken plugin (tests/broken_plugins/) fails with a message
that points at its fault, while the cases it does not break still pass. The plugins register like a user's:
a `*.dist-info/entry_points.txt` on sys.path, found by importlib.metadata in the `flashnext.backends` group."""

import re
from pathlib import Path

import pytest

from conformance_helpers import conformance, env_with, listed

PLUGINS = Path(__file__).parent / "broken_plugins"

# plugin -> (-k selection, pattern every failing case name matches, text a failure message carries,
#            text no failure message may carry: a wrong diagnosis)
FAULTS = {
    "rope": ("rope or rmsnorm", r"rope\[", "rope nmse", None),
    "fp8": ("linear", r"(linear_fp8_activation_range|fp8_linear_edges|linear)\[fp8-e5m2", "got inf (+inf)", None),
    "partial": ("attention or store_kv", r"attention\[", "rows are off by more than 1% or in NaN/Inf (rows 24)", None),
    "int4": ("engine_precision", r"engine_precision\[int4\]", "full-precision weights, not int4", None),
    "crash": (
        "silu_and_mul or rmsnorm",
        r"silu_and_mul\[",
        "RuntimeError: no silu_and_mul kernel built for shape",
        None,
    ),
    # 0.5% faults: within the old bounds, each must now fail its own op by name.
    "rmsnorm": ("rmsnorm", r"rmsnorm\[", "rmsnorm systematic scale error: the output is 1.00500 x", None),
    "softmax": ("attention", r"attention\[", "attention nmse", None),
    "longctx": (
        "attention",
        r"attention\[(fp32|bf16|fp16|fp8-e4m3|fp8-e5m2|int4)-(decode-split-kv-4k|chunk-past-2k)\]",
        "attention nmse",
        None,
    ),
    "fp8quant": (
        "fp8_weights or fp8_linear",
        r"fp8_(weights_through_backend|linear_edges)\[",
        "bytes are NaN/inf",
        None,
    ),
    "prefixcache": (
        "prefix_cache or batch_invariance",
        r"prefix_cache_hit_equals_miss",
        "declared off, yet cached prefix tokens",
        None,
    ),
    # Faults only a batch shows: the invariant fails and names the op where batched and alone runs part.
    "tile": (
        "batch_invariance or linear",
        r"batch_invariance",
        "first divergence at layer 0 linear (qkv), normalized error",
        None,
    ),
    "nanlogits": (
        "(engine_precision and fp32) or seeded or batch",
        r"(engine_precision\[|seeded_determinism|batch_invariance)",
        "non-finite logits",
        "full-precision weights|changed no token",
    ),
}


def _install(tmp_path: Path, fault: str, kind: str = "broken") -> Path:
    site = tmp_path / "site"
    info = site / f"flashnext_{kind}_{fault}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flashnext-{kind}-{fault}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[flashnext.backends]\n{kind}-{fault} = flashnext_{kind}_{fault}\n")
    return site


@pytest.mark.parametrize("fault", list(FAULTS))
def test_broken_plugin_is_caught(tmp_path, fault):
    select, failing, pointer, wrong = FAULTS[fault]
    env = env_with([_install(tmp_path, fault), PLUGINS])
    assert listed(env)[f"broken-{fault}"]["origin"] == f"flashnext-broken-{fault} 0.1"

    code, report, junit, proc = conformance(f"broken-{fault}", tmp_path, env, select)
    assert code == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    failed = [c for c in report["cases"] if c["passed"] is False]
    assert failed, "the fault went unnoticed"
    assert all(re.match(failing, c["name"]) for c in failed), [c["name"] for c in failed]
    assert any(pointer in c["message"] for c in failed), [c["message"] for c in failed]
    assert not wrong or not any(re.search(wrong, c["message"]) for c in failed), [c["message"] for c in failed]
    assert any(c["passed"] for c in report["cases"]), "cases the fault does not touch must still pass"
    assert 'failures="0"' not in junit.read_text()
    assert "FAIL" in proc.stdout and pointer in " ".join(proc.stdout.split())  # the printed summary says it too


def test_correct_bf16_int4_plugin_passes_the_engine_cases(tmp_path):
    """bf16 and int4 only, the CPU's kernels: rounding at bf16 must not fail an invariant or blame a feature."""
    env = env_with([_install(tmp_path, "npu", "correct"), PLUGINS])
    select = "feature or prefix_cache or batch_invariance or seeded or engine_precision or undeclared"
    code, report, _, proc = conformance("correct-npu", tmp_path, env, select)
    assert code == 0, [c["message"] for c in report["cases"] if c["passed"] is False] if report else proc.stderr
    assert {c["precision"] for c in report["cases"] if c["name"].startswith("engine_precision")} == {"bf16", "int4"}


@pytest.mark.slow
def test_correct_bf16_int4_plugin_passes_the_whole_suite(tmp_path):
    """Including e2e_default_model, whose greedy case once demanded 8 equal tokens at bf16."""
    env = env_with([_install(tmp_path, "npu", "correct"), PLUGINS])
    code, report, _, proc = conformance("correct-npu", tmp_path, env)
    assert code == 0, [c["message"] for c in report["cases"] if c["passed"] is False] if report else proc.stderr
    e2e = [c for c in report["cases"] if c["name"].startswith("e2e_default_model")]
    assert e2e and all(c["passed"] for c in e2e), e2e
