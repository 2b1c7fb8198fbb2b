"""The rocm backend on fixtures: no AMD GPU here. torch answers as a ROCm build (rocm_fakes.rocm_torch), amdsmi is a
fake module with the real names and value shapes, rocm-smi an executable printing real output."""

import json
import math
import sys
import types
from contextlib import nullcontext

import pytest
import torch
from typer.testing import CliRunner

from flashnext.core import registry
from flashnext.core.cli import app
from flashnext.core.errors import UserError
from flashnext.core.kernels import AttentionMetadata, ReferenceKernels
from flashnext.core.metrics import ServerMetrics
from flashnext.plugins.cuda import CudaBackend, cuda_probe
from flashnext.plugins.rocm import RocmBackend, attention, clocks
from flashnext.plugins.rocm.attention import FlashAttnPrefill, choose_attention
from flashnext.plugins.rocm.device import GFX_TARGETS
from rocm_fakes import fake_amdsmi, fake_flash_attn, install_rocm_smi, no_amdsmi, path_with_only, rocm_torch

runner = CliRunner()


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No real amdsmi, rocm-smi or flash_attn leaks in; each test installs the fakes it means."""
    no_amdsmi(monkeypatch)
    path_with_only(monkeypatch, tmp_path / "bin")
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.delenv("FLASHNEXT_ATTENTION", raising=False)
    monkeypatch.delenv("FLASHNEXT_STRICT_CLOCKS", raising=False)
    attention.load_flash_attn.cache_clear()
    monkeypatch.setattr(clocks, "memory_traffic", lambda device: nullcontext())  # no device to load here
    yield
    attention.load_flash_attn.cache_clear()


def prepared(backend, precision, profile):
    """What the engine does with a request: the query (check_request), then the action (prepare_engine)."""
    chosen = backend.check_request(precision, profile)
    backend.prepare_engine(chosen, profile)
    return chosen


def use_amdsmi(monkeypatch, fixture: str, **options):
    mod = fake_amdsmi(fixture, **options)
    monkeypatch.setitem(sys.modules, "amdsmi", mod)
    return mod


# -- HBM clock readings ---------------------------------------------------------------------------------------


def test_amdsmi_at_full_clocks_is_no_problem_and_shuts_down_what_it_opens(monkeypatch):
    smi = use_amdsmi(monkeypatch, "amdsmi_mi300x_full.json")
    report = clocks.read_memory_clocks()
    assert report.source == "amdsmi" and [(c.mhz, c.max_mhz) for c in report.clocks] == [(1300, 1300)] * 2
    assert report.problem() is None and report.readable
    assert smi.calls == {"init": 1, "shut_down": 1}


def test_amdsmi_low_hbm_names_the_gpu_and_the_remedy(monkeypatch):
    use_amdsmi(monkeypatch, "amdsmi_mi300x_low_hbm.json")
    problem = clocks.read_memory_clocks().problem()
    assert "GPU 0 at 900 MHz of 1300 MHz" in problem and "GPU 1" not in problem
    assert "a third" in problem and "amd-smi set --perf-level HIGH" in problem and "\n" not in problem


def test_amdsmi_na_values_are_unknown_not_zero(monkeypatch):
    use_amdsmi(monkeypatch, "amdsmi_mi300x_na.json")
    report = clocks.read_memory_clocks()
    assert report.clocks[0].mhz is None and report.clocks[0].max_mhz is None and report.clocks[0].locked is None
    assert report.problem() is None and not report.readable and "N/A of N/A" in report.summary()


def test_rocm57_cur_clk_field_is_read(monkeypatch):
    use_amdsmi(monkeypatch, "amdsmi_rocm57_mi210.json")
    assert [(c.mhz, c.max_mhz) for c in clocks.read_memory_clocks().clocks] == [(1600, 1600)]


def test_amdsmi_missing_reads_rocm_smi_text(monkeypatch, tmp_path):
    install_rocm_smi(tmp_path / "bin", "rocm_smi_mi300x_low_hbm.txt")
    report = clocks.read_memory_clocks()
    assert report.source == "rocm-smi"
    assert [(c.gpu, c.mhz, c.max_mhz) for c in report.clocks] == [(0, 900, 1300), (1, 1300, 1300)]
    assert "GPU 0 at 900 MHz of 1300 MHz" in report.problem()


def test_amdsmi_failing_to_init_falls_back_to_rocm_smi(monkeypatch, tmp_path):
    use_amdsmi(monkeypatch, "amdsmi_mi300x_full.json", init_fails=True)
    install_rocm_smi(tmp_path / "bin", "rocm_smi_mi300x_full.txt")
    report = clocks.read_memory_clocks()
    assert report.source == "rocm-smi" and report.problem() is None and report.readable


def test_rocm_smi_json_gives_the_clock_but_no_maximum(monkeypatch, tmp_path):
    install_rocm_smi(tmp_path / "bin", None, "rocm_smi_mi300x_showclocks.json")
    report = clocks.read_memory_clocks()
    assert report.source == "rocm-smi --json"
    assert [(c.gpu, c.mhz, c.max_mhz) for c in report.clocks] == [(0, 900, None), (1, 1300, None)]
    assert report.problem() is None and not report.readable


def test_neither_amdsmi_nor_rocm_smi_says_how_to_get_one():
    report = clocks.read_memory_clocks()
    assert report.clocks == [] and "pip install amdsmi" in report.source and "rocm-smi is not on PATH" in report.source


def test_text_parser_takes_the_highest_supported_level_and_letter_levels():
    text = (
        "GPU[3]\t\t: mclk clock level: S: (96Mhz)\nGPU[3]\t\t: Supported mclk frequencies on GPU3\n"
        "GPU[3]\t\t: 0: 96Mhz *\nGPU[3]\t\t: 1: 456Mhz\nGPU[3]\t\t: 2: 1124Mhz\nGPU[3]\t\t: \n"
        "GPU[3]\t\t: Supported sclk frequencies on GPU3\nGPU[3]\t\t: 0: 2500Mhz\n"
    )
    assert [(c.gpu, c.mhz, c.max_mhz) for c in clocks.parse_rocm_smi_text(text)] == [(3, 96, 1124)]


# -- probes by gfx target -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gpu, fixture, gfx, fp8, flash",
    [
        ("mi300x", "amdsmi_mi300x_full.json", "gfx942", "float8_e4m3fnuz / float8_e5m2fnuz", True),
        ("mi355x", None, "gfx950", "float8_e4m3fn / float8_e5m2", True),
        ("mi210", "amdsmi_rocm57_mi210.json", "gfx90a", "none: gfx90a has no FP8", True),
        ("rx7900", None, "gfx1100", "none: gfx1100 has no FP8", False),
    ],
)
def test_probe_gates_on_the_gfx_name(monkeypatch, gpu, fixture, gfx, fp8, flash):
    rocm_torch(monkeypatch, gpu, count=8)
    if fixture:
        use_amdsmi(monkeypatch, fixture)
    probe = RocmBackend().probe()
    assert probe.available and probe.score > 100 and gfx in probe.reason
    assert probe.facts["gfx_target"] == gfx and probe.facts["fp8"] == fp8 and probe.facts["device_count"] == 8
    assert GFX_TARGETS[gfx].flash_attn is flash


@pytest.mark.parametrize(
    "gpu, e4m3, e5m2",
    [
        ("mi300x", torch.float8_e4m3fnuz, torch.float8_e5m2fnuz),
        ("mi355x", torch.float8_e4m3fn, torch.float8_e5m2),
    ],
)
def test_fp8_is_stored_in_the_targets_format(monkeypatch, gpu, e4m3, e5m2):
    rocm_torch(monkeypatch, gpu)
    backend = RocmBackend()
    basic = backend.profiles()["basic"]
    assert backend.check_request("fp8-e4m3", basic).storage_dtype == e4m3
    assert backend.check_request("fp8-e5m2", basic).storage_dtype == e5m2


@pytest.mark.parametrize("gpu, gfx", [("mi210", "gfx90a"), ("rx7900", "gfx1100")])
def test_fp8_is_refused_by_gfx_name_not_by_major_minor(monkeypatch, gpu, gfx):
    rocm_torch(monkeypatch, gpu)
    from rocm_fakes import GPUS

    assert (GPUS[gpu].major, GPUS[gpu].minor) >= (8, 9)  # what a CUDA-style capability test would let through
    backend = RocmBackend()
    for precision in ("fp8-e4m3", "fp8-e5m2"):
        with pytest.raises(UserError, match=f"{precision} needs FP8 hardware.* is {gfx}: use --precision bf16"):
            backend.check_request(precision, backend.profiles()["basic"])
    assert backend.check_request("int4", backend.profiles()["basic"]).name == "int4"


def test_product_from_the_pci_device_id_when_torch_names_it_generically(monkeypatch, tmp_path):
    rocm_torch(monkeypatch, "mi300x")
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda index=0: types.SimpleNamespace(**{**vars(__import__("rocm_fakes").GPUS["mi300x"]), "name": ""}),
    )
    mod = use_amdsmi(monkeypatch, "amdsmi_mi300x_full.json")
    original = mod.amdsmi_get_gpu_asic_info
    mod.amdsmi_get_gpu_asic_info = lambda h: original(h) | {"device_id": "0x74a5", "market_name": "N/A"}
    assert RocmBackend().probe().facts["device"] == "AMD Instinct MI325X"


def test_cuda_steps_aside_on_a_rocm_torch_and_auto_picks_rocm(monkeypatch):
    rocm_torch(monkeypatch, "mi300x")
    probe = cuda_probe()
    assert not probe.available and "rocm backend" in probe.reason
    entries = [e for e in registry.discover() if e.name in ("cpu", "cuda", "rocm")]
    assert registry.select(entries, "auto").name == "rocm"


def test_no_rocm_torch_or_no_gpu_is_unavailable_with_the_fix(monkeypatch):
    assert "not a ROCm build" in RocmBackend().probe().reason
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    probe = RocmBackend().probe()
    assert not probe.available and "/dev/kfd" in probe.reason


def test_full_profile_has_graphs_chunking_and_ngram_and_basic_rolls_back():
    profiles = RocmBackend().profiles()
    full, basic = profiles["full"], profiles["basic"]
    assert full.cuda_graphs and full.chunked_prefill and full.spec == "ngram"
    assert not basic.cuda_graphs and not basic.chunked_prefill and basic.spec == "none" and basic.prefix_caching
    assert RocmBackend().default_profile == "full" and issubclass(RocmBackend, CudaBackend)


# -- attention selection --------------------------------------------------------------------------------------


def test_selector_flash_attn_present_absent_and_by_target(monkeypatch):
    cdna3, rdna3 = GFX_TARGETS["gfx942"], GFX_TARGETS["gfx1100"]
    absent = choose_attention("auto", "gfx942", cdna3, torch.bfloat16)
    assert absent.prefill == "triton" and "flash_attn does not import" in absent.reason
    fake_flash_attn(monkeypatch)
    assert choose_attention("auto", "gfx942", cdna3, torch.bfloat16).prefill == "flash_attn"
    rdna = choose_attention("auto", "gfx1100", rdna3, torch.float16)
    assert rdna.prefill == "triton" and "does not support gfx1100" in rdna.reason
    fp32 = choose_attention("auto", "gfx942", cdna3, torch.float32)
    assert fp32.prefill == "triton" and "not float32" in fp32.reason
    assert choose_attention("triton", "gfx942", cdna3, torch.bfloat16).prefill == "triton"
    with pytest.raises(UserError, match="attention 'flash_attn' cannot run here: .*gfx1100"):
        choose_attention("flash_attn", "gfx1100", rdna3, torch.float16)


def test_profile_and_env_override_reach_the_backend(monkeypatch):
    rocm_torch(monkeypatch, "mi300x")
    fake_flash_attn(monkeypatch)
    backend = RocmBackend()
    prepared(backend, "bf16", backend.profiles()["basic"])
    assert backend.attention_choice().prefill == "flash_attn"
    prepared(backend, "bf16", backend.profiles()["basic"].overridden(attention="triton"))
    assert backend.attention_choice().prefill == "triton"
    monkeypatch.setenv("FLASHNEXT_ATTENTION", "triton")
    assert RocmBackend().probe().facts["attention"]["prefill"] == "triton"
    with pytest.raises(UserError, match="attention 'sdpa' is not offered by backend 'rocm'"):
        backend.check_request("bf16", backend.profiles()["basic"].overridden(attention="sdpa"))


def paged_step(head_dim: int, query_lens, context_lens, dtype=torch.float16, block_size=4, heads=4, kv_heads=2):
    """A filled paged cache and one step's queries and metadata; sequence i's blocks are scattered."""
    torch.manual_seed(0)
    blocks_each = [-(-c // block_size) for c in context_lens]
    order = torch.randperm(sum(blocks_each)).tolist()
    tables, start = [], 0
    for n in blocks_each:
        tables.append(order[start : start + n])
        start += n
    k_cache = torch.randn(len(order), block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(len(order), block_size, kv_heads, head_dim).to(dtype)
    slots = [
        t[p // block_size] * block_size + p % block_size
        for t, q, c in zip(tables, query_lens, context_lens)
        for p in range(c - q, c)
    ]
    meta = AttentionMetadata.from_host(slots, list(query_lens), list(context_lens), tables, "cpu")
    q = torch.randn(sum(query_lens), heads, head_dim).to(dtype)
    return q, k_cache, v_cache, meta


def flash_kernels(monkeypatch):
    kernels = type("FlashAttnReferenceKernels", (FlashAttnPrefill, ReferenceKernels), {})()
    kernels.flash_attn_varlen_func = sys.modules["flash_attn"].flash_attn_varlen_func
    return kernels


def test_flash_prefill_passes_the_varlen_arguments_and_matches_the_reference(monkeypatch):
    calls = fake_flash_attn(monkeypatch)
    kernels = flash_kernels(monkeypatch)
    # a whole prompt, a later chunk of a prompt (context > its queries), and a decode row in the same step
    q, k_cache, v_cache, meta = paged_step(64, query_lens=[5, 3, 1], context_lens=[5, 9, 6])
    out = kernels.attention(q, k_cache, v_cache, meta, 0.125)
    expected = ReferenceKernels().attention(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-3, rtol=2e-3)
    (call,) = calls
    assert call["cu_seqlens_q"].tolist() == [0, 5, 8, 9] and call["cu_seqlens_k"].tolist() == [0, 5, 14, 20]
    assert call["cu_seqlens_k"].dtype == torch.int32 and call["max_seqlen_q"] == 5 and call["max_seqlen_k"] == 9
    assert call["causal"] is True and call["softmax_scale"] == 0.125 and call["k"].shape == (20, 2, 64)


@pytest.mark.parametrize(
    "head_dim, query_lens, context_lens, dtype",
    [
        (512, [5], [5], torch.float16),  # head dim past flash_attn's 256
        (64, [1, 1], [5, 7], torch.float16),  # decode
        (64, [5], [5], torch.float32),  # not 16-bit
    ],
)
def test_steps_flash_attn_cannot_take_stay_on_the_kernel_below(monkeypatch, head_dim, query_lens, context_lens, dtype):
    calls = fake_flash_attn(monkeypatch)
    kernels = flash_kernels(monkeypatch)
    q, k_cache, v_cache, meta = paged_step(head_dim, query_lens, context_lens, dtype)
    out = kernels.attention(q, k_cache, v_cache, meta, 1 / math.sqrt(head_dim))
    assert calls == []
    torch.testing.assert_close(out, ReferenceKernels().attention(q, k_cache, v_cache, meta, 1 / math.sqrt(head_dim)))


# -- the clock check before serving ---------------------------------------------------------------------------


def test_low_hbm_warns_before_serving_and_checks_once(monkeypatch, capsys):
    rocm_torch(monkeypatch, "mi300x")
    smi = use_amdsmi(monkeypatch, "amdsmi_mi300x_low_hbm.json")
    backend = RocmBackend()
    prepared(backend, "bf16", backend.profiles()["full"])
    prepared(backend, "int4", backend.profiles()["full"])
    err = capsys.readouterr().err
    assert err.count("warning: HBM memory clock below its maximum under load (GPU 0 at 900 MHz of 1300 MHz") == 1
    assert smi.calls["init"] == 2  # the target (asic) read and the clock read; not again on the second request


def test_check_request_is_a_query_the_clock_check_and_attention_come_with_prepare(monkeypatch, capsys):
    rocm_torch(monkeypatch, "mi300x")
    smi = use_amdsmi(monkeypatch, "amdsmi_mi300x_low_hbm.json")
    backend = RocmBackend()
    strict = backend.profiles()["full"].overridden(strict_clocks=True)
    for precision in ("bf16", "int4", "fp8-e4m3"):
        backend.check_request(precision, strict)  # also what the engine asks when the weights do not fit
    assert backend.attention_choice() is None and smi.calls["init"] == 1  # the target's read, no clock read
    assert capsys.readouterr().err == ""
    with pytest.raises(UserError, match="GPU 0 at 900 MHz of 1300 MHz"):
        backend.prepare_engine(backend.check_request("bf16", strict), strict)
    assert backend.attention_choice() is not None


def test_low_hbm_with_strict_clocks_refuses(monkeypatch):
    rocm_torch(monkeypatch, "mi300x")
    use_amdsmi(monkeypatch, "amdsmi_mi300x_low_hbm.json")
    backend = RocmBackend()
    with pytest.raises(UserError, match="GPU 0 at 900 MHz of 1300 MHz.*or start without --strict-clocks"):
        prepared(backend, "bf16", backend.profiles()["full"].overridden(strict_clocks=True))


@pytest.mark.parametrize(
    "env, gpu",
    [
        ({}, 0),
        ({"HIP_VISIBLE_DEVICES": "1"}, 1),
        ({"CUDA_VISIBLE_DEVICES": "1"}, 1),
        ({"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "1"}, 0),  # HIP's own variable wins
        ({"ROCR_VISIBLE_DEVICES": "1,3", "HIP_VISIBLE_DEVICES": "1"}, 3),  # HIP indexes ROCr's pick
        ({"ROCR_VISIBLE_DEVICES": "2"}, 2),
        ({"ROCR_VISIBLE_DEVICES": "GPU-4a7c3d2b1e0f9a8b"}, None),  # a UUID: every GPU is read
    ],
)
def test_the_serving_gpu_follows_the_visible_devices_lists(env, gpu):
    assert clocks.serving_gpu(env) == gpu


def test_the_clock_check_reads_only_the_gpu_it_loads(monkeypatch, capsys):
    """GPU 0's HBM is low; a process given GPU 1 loads and checks GPU 1 alone, and strict clocks pass."""
    rocm_torch(monkeypatch, "mi300x")
    use_amdsmi(monkeypatch, "amdsmi_mi300x_low_hbm.json")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    backend = RocmBackend()
    strict = backend.profiles()["full"].overridden(strict_clocks=True)
    backend.prepare_engine(backend.check_request("bf16", strict), strict)
    assert "warning" not in capsys.readouterr().err
    assert backend.device_telemetry()["memory_clock_mhz"] == 1300
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0")
    with pytest.raises(UserError, match="GPU 0 at 900 MHz"):
        RocmBackend().prepare_engine(backend.check_request("bf16", strict), strict)


def test_strict_clocks_refuses_when_the_clock_cannot_be_read(monkeypatch):
    rocm_torch(monkeypatch, "mi300x")
    use_amdsmi(monkeypatch, "amdsmi_mi300x_na.json")
    backend = RocmBackend()
    with pytest.raises(UserError, match="cannot check the HBM clock under load"):
        prepared(backend, "bf16", backend.profiles()["full"].overridden(strict_clocks=True))


def test_full_clocks_pass_strict(monkeypatch, capsys):
    rocm_torch(monkeypatch, "mi300x")
    use_amdsmi(monkeypatch, "amdsmi_mi300x_full.json")
    backend = RocmBackend()
    prepared(backend, "bf16", backend.profiles()["full"].overridden(strict_clocks=True))
    assert "warning" not in capsys.readouterr().err


def test_cli_strict_clocks_is_a_one_line_refusal_exit_2(monkeypatch, tiny_llama):
    rocm_torch(monkeypatch, "mi300x")
    use_amdsmi(monkeypatch, "amdsmi_mi300x_low_hbm.json")
    result = runner.invoke(
        app, ["run", "hello", "--model", str(tiny_llama), "--backend", "rocm", "--strict-clocks", "--max-tokens", "1"]
    )
    assert result.exit_code == 2
    lines = [x for x in result.output.strip().splitlines() if not x.endswith(" s)")]  # progress stages before it
    assert len(lines) == 1 and lines[0].startswith("error: HBM memory clock below its maximum under load")


# -- telemetry in /metrics and /health ------------------------------------------------------------------------


def test_memory_clock_reaches_metrics_and_health(monkeypatch, tiny_llama):
    from flashnext.core.llm import LLM
    from flashnext.core.server import Server

    llm = LLM(tiny_llama, backend="cpu", max_num_seqs=2, max_num_batched_tokens=32, kv_cache_max_gib=0.01)
    rocm_torch(monkeypatch, "mi300x")
    smi = use_amdsmi(monkeypatch, "amdsmi_mi300x_low_hbm.json")
    backend = RocmBackend()
    prepared(backend, "bf16", backend.profiles()["full"])  # what the engine asks first: the attention choice
    opened = smi.calls["init"]
    monkeypatch.setattr(llm.engine, "backend", backend)  # a CPU engine reporting the ROCm fixture's device
    text = ServerMetrics(llm.engine).render().decode()
    assert "flashnext_device_memory_clock_mhz 900.0" in text
    assert "flashnext_device_memory_clock_max_mhz 1300.0" in text
    health = json.loads(Server(llm).health().body)
    assert health["device"]["memory_clock_mhz"] == 900.0 and health["device"]["memory_clock_max_mhz"] == 1300.0
    assert (
        health["device"]["attention"]["prefill"] == "triton" and "flash_attn" in health["device"]["attention"]["reason"]
    )
    assert smi.calls["init"] == opened + 1  # a scrape and a /health moments apart share one reading


def test_unreadable_telemetry_is_left_out_and_other_kinds_are_exposed():
    from prometheus_client import CollectorRegistry, generate_latest

    from flashnext.core.metrics import device_metrics

    class Device:
        def __init__(self, telemetry):
            self.telemetry = telemetry

        def collect(self):
            return device_metrics(self.telemetry)

    def render(telemetry):
        reg = CollectorRegistry()
        reg.register(Device(telemetry))
        return generate_latest(reg).decode()

    assert "flashnext_device" not in render({})
    text = render({"temperature_celsius": {"gpu": 51.5, "cpu": 48.0}, "power_mode": "MAXN"})
    assert 'flashnext_device_temperature_celsius{zone="gpu"} 51.5' in text
    assert 'flashnext_device_power_mode_info{mode="MAXN"} 1.0' in text and "memory_clock" not in text


# -- backends --explain for each fixture ----------------------------------------------------------------------


EXPLAIN_CASES = {
    "mi300x-full-clocks": ("mi300x", "amdsmi_mi300x_full.json", None, "amdsmi): GPU 0 1300 MHz of 1300 MHz"),
    "mi300x-low-hbm": ("mi300x", "amdsmi_mi300x_low_hbm.json", None, "GPU 0 900 MHz of 1300 MHz"),
    "mi300x-values-na": ("mi300x", "amdsmi_mi300x_na.json", None, "GPU 0 N/A of N/A"),
    "amdsmi-missing-rocm-smi-present": ("mi300x", None, "rocm_smi_mi300x_low_hbm.txt", "(rocm-smi): GPU 0 900 MHz"),
    "neither-present": ("mi300x", None, None, "memory clock unknown: amdsmi is not installed"),
    "mi210-rocm57-amdsmi": ("mi210", "amdsmi_rocm57_mi210.json", None, "GPU 0 1600 MHz of 1600 MHz"),
    "mi355x-rocm-smi-json-only": (
        "mi355x",
        None,
        (None, "rocm_smi_mi300x_showclocks.json"),
        "(rocm-smi --json): GPU 0 900 MHz of N/A",
    ),
    "rx7900-neither-present": ("rx7900", None, None, "memory clock unknown"),
    "mi300x-flash-attn-present": ("mi300x", "amdsmi_mi300x_full.json", None, "GPU 0 1300 MHz of 1300 MHz"),
}
TARGET_FACTS = {
    "mi300x": ("gfx942", "float8_e4m3fnuz / float8_e5m2fnuz"),
    "mi355x": ("gfx950", "float8_e4m3fn / float8_e5m2"),
    "mi210": ("gfx90a", "none: gfx90a has no FP8"),
    "rx7900": ("gfx1100", "none: gfx1100 has no FP8"),
}


def render_explain(monkeypatch, tmp_path, case: str) -> str:
    gpu, amdsmi_fixture, rocm_smi_fixture, _ = EXPLAIN_CASES[case]
    rocm_torch(monkeypatch, gpu, count=8)
    if amdsmi_fixture:
        use_amdsmi(monkeypatch, amdsmi_fixture)
    if "flash-attn-present" in case:
        fake_flash_attn(monkeypatch)
    if rocm_smi_fixture:
        text, js = rocm_smi_fixture if isinstance(rocm_smi_fixture, tuple) else (rocm_smi_fixture, None)
        install_rocm_smi(tmp_path / "bin", text, js)
    monkeypatch.setenv("COLUMNS", "250")
    result = runner.invoke(app, ["backends", "--explain"])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("case", list(EXPLAIN_CASES))
def test_backends_explain_for_each_fixture(monkeypatch, tmp_path, case):
    output = render_explain(monkeypatch, tmp_path, case)
    print(f"\n--- flashnext backends --explain [{case}] ---\n{output}")
    rocm_line = next(line for line in output.splitlines() if line.startswith("rocm: "))
    facts = json.loads(rocm_line.removeprefix("rocm: "))
    assert EXPLAIN_CASES[case][3] in facts["memory_clock"]["idle_reading"]
    assert (facts["gfx_target"], facts["fp8"]) == TARGET_FACTS[EXPLAIN_CASES[case][0]]
    if "flash-attn-present" in case:
        assert facts["attention"]["prefill"] == "flash_attn" and "head dim <= 256" in facts["attention"]["reason"]
    else:
        assert facts["attention"]["prefill"] == "triton"
        why_not = "does not support gfx1100" if facts["gfx_target"] == "gfx1100" else "flash_attn does not import"
        assert why_not in facts["attention"]["reason"]
    rocm_row = next(line for line in output.splitlines() if line.startswith("│ rocm"))
    assert ("fp8-e4m3" in rocm_row) == (facts["fp8"] != f"none: {facts['gfx_target']} has no FP8")
    assert "rocm backend serves it" in output  # cuda's row


def test_a_steps_context_slots_are_built_once_for_all_layers(monkeypatch):
    calls = fake_flash_attn(monkeypatch)
    kernels = flash_kernels(monkeypatch)
    built = []
    real = attention.context_slots
    monkeypatch.setattr(attention, "context_slots", lambda *a: built.append(1) or real(*a))
    q, k_cache, v_cache, meta = paged_step(64, query_lens=[5, 3], context_lens=[5, 9])
    for _layer in range(3):
        kernels.attention(q, k_cache, v_cache, meta, 0.125)
    _, _, _, next_meta = paged_step(64, query_lens=[4], context_lens=[4])
    kernels.attention(q[:4], k_cache, v_cache, next_meta, 0.125)
    assert len(calls) == 4 and len(built) == 2
