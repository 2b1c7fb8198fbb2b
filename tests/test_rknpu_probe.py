"""The RK3588 probe against filesystem roots of real boards (tests/fixtures/rk3588/)."""

from pathlib import Path

import pytest

from flashnext.plugins.cpu import CpuBackend
from flashnext.plugins.rknpu import RknpuBackend
from flashnext.plugins.rknpu import probe as board
from rknpu_fakes import fake_rknnlite

ROOTS = Path(__file__).parent / "fixtures" / "rk3588"


def test_rock5b_reads_every_fact():
    facts = board.board_facts(ROOTS / "rock5b")
    assert facts["soc"] == "rk3588" and facts["compatible"] == ["radxa,rock-5b", "rockchip,rk3588"]
    assert facts["librknnrt"].endswith("usr/lib/librknnrt.so")
    assert facts["rknpu_driver"] == "0.9.8"
    assert facts["npu_load"] == {"core0": 12, "core1": 5, "core2": 0}
    assert facts["npu_freq_hz"] == 1_000_000_000 and facts["npu_governor"] == "rknpu_ondemand"
    assert facts["npu_available_frequencies"].split()[0] == "300000000"


def test_orangepi5_is_an_rk3588s():
    facts = board.board_facts(ROOTS / "orangepi5")
    assert facts["soc"] == "rk3588s" and facts["rknpu_driver"] == "0.9.6" and facts["npu_freq_hz"] == 300_000_000


def test_broken_board_reports_what_it_could_not_parse():
    facts = board.board_facts(ROOTS / "broken")
    assert facts["soc"] == "rk3588" and facts["librknnrt"] is None
    assert facts["rknpu_driver"].startswith("unrecognised") and facts["npu_load"].startswith("unrecognised")
    assert "npu_freq_hz" not in facts


def test_debugfs_readable_only_by_root_says_so(monkeypatch):
    real = Path.read_text

    def deny(self, *args, **kwargs):
        if "debug/rknpu" in str(self):
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", deny)
    facts = board.board_facts(ROOTS / "rock5b")
    assert facts["rknpu_driver"] == facts["npu_load"] == board.ROOT_ONLY == "unreadable: root only (debugfs)"
    assert facts["npu_freq_hz"] == 1_000_000_000


def test_not_a_board_has_no_soc(tmp_path):
    assert board.board_facts(tmp_path) == {"soc": None, "compatible": [], "librknnrt": None}


def test_board_with_runtime_scores_above_cpu_and_defaults_to_the_npu():
    backend = RknpuBackend(ROOTS / "rock5b", rknnlite=fake_rknnlite())
    probe = backend.probe()
    assert probe.available and probe.score > CpuBackend().probe().score
    assert probe.facts["runtime"] == "rknnlite" and "RK3588 NPU" in probe.reason
    assert backend.default_profile == "npu" and backend.profiles()["npu"].npu_cores == "0_1_2"


@pytest.mark.parametrize("root", ["broken", None])
def test_without_npu_runtime_onnxruntime_runs_below_cpu(root, tmp_path):
    backend = RknpuBackend(ROOTS / root if root else tmp_path)
    probe = backend.probe()
    assert probe.available and probe.score < CpuBackend().probe().score
    assert probe.facts["runtime"] == "onnxruntime" and backend.default_profile == "onnxruntime"
    assert ("RK3588 found but no NPU runtime" if root else "no RK3588 here") in probe.reason


def test_profiles_keep_the_board_limits():
    for profile in RknpuBackend(ROOTS / "rock5b").profiles().values():
        assert profile.max_num_seqs == 4 and profile.max_tokens_cap == 64 and not profile.prefix_caching
    basic = RknpuBackend(ROOTS / "rock5b").profiles()["basic"]
    assert not basic.chunked_prefill and basic.runtime == "onnxruntime"  # no rknnlite module here
