"""The conformance suite must catch real faults: each broken plugin (tests/broken_plugins/) fails with a message
that points at its fault, while the cases it does not break still pass. The plugins register like a user's:
a `*.dist-info/entry_points.txt` on sys.path, found by importlib.metadata in the `flashnext.backends` group."""

from pathlib import Path

import pytest

from conformance_helpers import conformance, env_with, listed

PLUGINS = Path(__file__).parent / "broken_plugins"

# plugin -> (-k selection, prefix of every failing case, text every failure message carries)
FAULTS = {
    "rope": ("rope or rmsnorm", "rope[", "rope nmse"),
    "fp8": ("linear", "linear_fp8_activation_range[fp8-e5m2]", "got inf (+inf)"),
    "partial": ("attention or store_kv", "attention[", "1 of 25 rows are off by more than 1% or in NaN/Inf (rows 24)"),
    "int4": ("engine_precision", "engine_precision[int4]", "full-precision weights, not int4"),
    "crash": ("silu_and_mul or rmsnorm", "silu_and_mul[", "RuntimeError: no silu_and_mul kernel built for shape"),
}


def _install(tmp_path: Path, fault: str) -> Path:
    site = tmp_path / "site"
    info = site / f"flashnext_broken_{fault}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flashnext-broken-{fault}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[flashnext.backends]\nbroken-{fault} = flashnext_broken_{fault}\n")
    return site


@pytest.mark.parametrize("fault", list(FAULTS))
def test_broken_plugin_is_caught(tmp_path, fault):
    select, failing_prefix, pointer = FAULTS[fault]
    env = env_with([_install(tmp_path, fault), PLUGINS])
    assert listed(env)[f"broken-{fault}"]["origin"] == f"flashnext-broken-{fault} 0.1"

    code, report, junit, proc = conformance(f"broken-{fault}", tmp_path, env, select)
    assert code == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    failed = [c for c in report["cases"] if c["passed"] is False]
    assert failed, "the fault went unnoticed"
    assert all(c["name"].startswith(failing_prefix) for c in failed), [c["name"] for c in failed]
    assert any(pointer in c["message"] for c in failed), [c["message"] for c in failed]
    assert any(c["passed"] for c in report["cases"]), "cases the fault does not touch must still pass"
    assert 'failures="0"' not in junit.read_text()
    assert "FAIL" in proc.stdout and pointer in " ".join(proc.stdout.split())  # the printed summary says it too
