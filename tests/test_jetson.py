"""The jetson backend against fixture roots in the boards' own file formats (tests/fixtures/jetson/<board>), with
torch's device and psutil's memory patched to what each board reports."""

import json
import os
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
from typer.testing import CliRunner

from flashnext.core.cli import app
from flashnext.core.config import ModelConfig
from flashnext.core.errors import UserError
from flashnext.core.llm import resolve_profile
from flashnext.plugins.jetson import JetsonBackend, UnifiedMemory, power
from flashnext.plugins.jetson.board import parse_boardids, parse_release, read_board

if not torch.cuda.is_available():  # the CUDA plugin's Triton kernels run interpreted on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

FIXTURES = Path(__file__).parent / "fixtures" / "jetson"
GIB = 1 << 30
Memory = namedtuple("Memory", "total available")


@dataclass
class Props:
    name: str
    major: int
    minor: int
    is_integrated: bool
    total_memory: int
    multi_processor_count: int


@dataclass
class Board:
    props: Props
    total_gib: float
    available_gib: float
    name: str
    l4t: str
    jetpack: str
    power_mode: tuple[str, int]
    gpu_mhz: float
    gpu_load: float
    hot_zones: tuple[str, ...] = ()


BOARDS = {
    "agx-orin-64gb-jp6": Board(
        Props("Orin", 8, 7, True, int(61.4 * GIB), 16),
        61.4,
        55.0,
        "Jetson AGX Orin 64GB",
        "36.4.3",
        "6.2",
        ("MAXN", 0),
        1300.5,
        0.473,
    ),
    "orin-nx-16gb-jp5": Board(
        Props("Orin", 8, 7, True, int(15.3 * GIB), 8),
        15.3,
        11.2,
        "Jetson Orin NX 16GB",
        "35.4.1",
        "5.1.2",
        ("15W", 2),
        611.25,
        0.0,
    ),
    "orin-nano-8gb-jp6": Board(
        Props("Orin", 8, 7, True, int(7.4 * GIB), 8),
        7.4,
        4.9,
        "Jetson Orin Nano 8GB (developer kit)",
        "36.3.0",
        "6.0",
        ("15W", 0),
        624.75,
        0.996,
        ("gpu-thermal", "tj-thermal"),
    ),
    "agx-thor-jp7": Board(
        Props("NVIDIA Thor", 11, 0, True, int(122.8 * GIB), 20),
        122.8,
        110.0,
        "Jetson AGX Thor T5000",
        "38.2.0",
        "7.0",
        ("MAXN", 0),
        1575.0,
        0.12,
    ),
}


def pretend_board(monkeypatch, name: str, props: Props | None = None) -> dict:
    """Make this machine look like board `name`: its root, torch's integrated GPU and psutil's memory. Returns the
    memory state: lower state["available"] to take memory."""
    board = BOARDS.get(name)
    props = props or board.props
    monkeypatch.setenv("FLASHNEXT_JETSON_ROOT", str(FIXTURES / name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    total, available = (board.total_gib, board.available_gib) if board else (64.0, 48.0)
    state = {"available": int(available * GIB)}
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory(int(total * GIB), state["available"]))
    return state


@pytest.fixture
def as_board(monkeypatch):
    return lambda name, props=None: pretend_board(monkeypatch, name, props)


@pytest.mark.parametrize("name", BOARDS)
def test_probe_names_the_board_its_release_and_capability(as_board, name):
    as_board(name)
    board = BOARDS[name]
    probe = JetsonBackend().probe()
    assert probe.available and probe.score > 100  # above cuda on a board
    facts = probe.facts
    assert (facts["board"], facts["l4t"], facts["jetpack"]) == (board.name, board.l4t, board.jetpack)
    assert facts["compute_capability"] == f"{board.props.major}.{board.props.minor}"
    assert board.name in probe.reason and f"JetPack {board.jetpack}" in probe.reason
    assert facts["memory_budget_gib"] == pytest.approx(board.available_gib * 0.75, abs=0.01)


def test_fp8_is_in_the_facts_by_capability(as_board):
    as_board("agx-orin-64gb-jp6")
    orin = JetsonBackend()
    assert "no FP8 tensor cores" in orin.probe().facts["fp8"]
    assert "int4" in orin.precisions and not any(p.startswith("fp8") for p in orin.precisions)
    as_board("agx-thor-jp7")
    thor = JetsonBackend()
    assert thor.probe().facts["fp8"] is True and "fp8-e4m3" in thor.precisions


def test_broken_board_says_what_it_could_not_read(as_board):
    as_board("broken", props=BOARDS["orin-nano-8gb-jp6"].props)
    probe = JetsonBackend().probe()
    facts = probe.facts
    unreadable = " ".join(facts["unreadable"])
    assert "etc/nv_tegra_release" in unreadable and "device-tree/model: missing" in unreadable
    assert "l4t" not in facts and "L4T ?" in probe.reason
    assert facts["power_mode"].startswith("unknown")
    assert facts["gpu_clock"]["cur_mhz"] is None and facts["gpu_clock"]["max_mhz"] is None  # a folder, "garbage"
    assert facts["temperature_celsius"] == {"cpu-thermal": 45.0}  # gpu-thermal reads "N/A"
    assert JetsonBackend().device_telemetry() == {"temperature_celsius": {"cpu-thermal": 45.0}}


def test_a_machine_without_tegra_files_is_not_a_jetson(as_board, tmp_path, monkeypatch):
    as_board("agx-orin-64gb-jp6")
    monkeypatch.setenv("FLASHNEXT_JETSON_ROOT", str(tmp_path))
    probe = JetsonBackend().probe()
    assert not probe.available and "not a Jetson board" in probe.reason and "FLASHNEXT_JETSON_ROOT" in probe.reason


def test_a_board_with_cpu_torch_says_which_wheel(monkeypatch):
    monkeypatch.setenv("FLASHNEXT_JETSON_ROOT", str(FIXTURES / "orin-nx-16gb-jp5"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    probe = JetsonBackend().probe()
    assert not probe.available and "JetPack 5.1.2" in probe.reason and probe.facts["board"] == "Jetson Orin NX 16GB"


def test_a_discrete_gpu_stands_in_for_a_board_only_when_asked(as_board, monkeypatch):
    as_board("agx-orin-64gb-jp6", props=Props("NVIDIA H200", 9, 0, False, 140 * GIB, 132))
    probe = JetsonBackend().probe()
    assert not probe.available and "FLASHNEXT_JETSON_ALLOW_DISCRETE=1" in probe.reason
    monkeypatch.setenv("FLASHNEXT_JETSON_ALLOW_DISCRETE", "1")
    backend = JetsonBackend()
    probe = backend.probe()
    assert probe.available and probe.score < 100 and "stood in for by discrete NVIDIA H200" in probe.reason
    assert backend.capability() == (8, 7)  # the board's: fp8 is refused as on an Orin
    with pytest.raises(UserError, match="8.7"):
        backend.check_request("fp8-e4m3", backend.profiles()["eager"])


@pytest.mark.parametrize(
    "text, l4t",
    [
        ("# R36 (release), REVISION: 4.3, GCID: 12345678, BOARD: generic, EABI: aarch64, DATE: x", "36.4.3"),
        ("# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, DATE: x", "35.4.1"),
        ("# R38 (release), REVISION: 2, GCID: 1, BOARD: generic", "38.2.0"),
        ("R36 4.3", None),
    ],
)
def test_release_line_gives_the_l4t_version(text, l4t):
    assert parse_release(text) == l4t


@pytest.mark.parametrize(
    "l4t, jetpack",
    [
        ("36.4.3", "6.2"),
        ("35.1.0", "5.0.2"),
        ("35.6.9", "5.1.x"),
        ("36.9.0", "6.x"),
        ("38.4.0", "7.x"),
        ("32.7.4", None),
    ],
)
def test_jetpack_from_l4t(tmp_path, l4t, jetpack):
    board = read_board(tmp_path)
    board.l4t = l4t
    assert board.jetpack == jetpack


@pytest.mark.parametrize("text, part", [("p3701-0005", "p3701-0005"), ("3767:0000:H.0", "p3767-0000"), ("junk", None)])
def test_boardids_in_both_spellings(text, part):
    assert parse_boardids(text) == part


@pytest.mark.parametrize("name", BOARDS)
def test_power_and_thermal_readers_on_each_board(name):
    board, root = BOARDS[name], FIXTURES / name
    mode = power.read_power_mode(root)  # the fixture's usr/sbin/nvpmodel prints what the board's does
    assert (mode.name, mode.id) == board.power_mode
    clock = power.read_gpu_clock(root)  # the GPU's devfreq entry, not the video engine's beside it
    assert (clock.cur_mhz, clock.load_ratio) == (board.gpu_mhz, board.gpu_load)
    zones = power.read_thermal_zones(root)
    assert zones and all(z.celsius > 0 for z in zones)  # the unpowered -256 C sensor is left out
    hot = [w.split()[0] for w in power.warnings(None, zones)]
    assert tuple(hot) == board.hot_zones
    assert bool(power.warnings(mode, [])) == (not mode.is_maximum)


def test_nvpmodel_output_and_failures_through_an_injected_runner():
    runs = []

    def run(argv):
        runs.append(argv)
        return "NV Power Mode: 25W\n3\n"

    mode = power.read_power_mode(Path("/"), run)
    assert runs == [["/usr/sbin/nvpmodel", "-q"]] and (mode.name, mode.id, mode.is_maximum) == ("25W", 3, False)
    assert power.read_power_mode(Path("/"), lambda argv: None) is None
    assert power.read_power_mode(FIXTURES / "broken") is None  # nvpmodel exits 1


def test_thermal_warning_names_the_zone_and_trip():
    zone = power.ThermalZone("gpu-thermal", 90.0, [("active", 70.0), ("passive", 99.0), ("critical", 104.5)])
    assert "within 10 C of its passive trip point (99.0 C)" in power.warnings(None, [zone])[0]
    zone.celsius = 88.9
    assert power.warnings(None, [zone]) == []


@pytest.mark.parametrize(
    "line, expected",
    [
        (
            "RAM 2235/15388MB (lfb 2775x4MB) SWAP 0/7694MB (cached 0MB) CPU [2%@729,0%@729,1%@729,0%@729,off,off,off,off] "  # noqa: E501 (a real line, as the tool prints it)
            "EMC_FREQ 0%@2133 GR3D_FREQ 0%@305 CPU@41.5C Tboard@32C SOC2@39.281C Tdiode@33C SOC0@39.843C CV1@-256C GPU@41.5C "  # noqa: E501 (a real line, as the tool prints it)
            "tj@41.5C SOC1@39.593C CV2@-256C VDD_IN 4367mW/4367mW VDD_CPU_GPU_CV 476mW/476mW VDD_SOC 1270mW/1270mW",
            {"ram_used_mb": 2235, "gpu_load_ratio": 0.0, "gpu_clock_mhz": 305, "gpu_temp": 41.5, "VDD_IN": 4367},
        ),
        (
            "RAM 4722/7844MB (lfb 1x512kB) SWAP 0/3922MB (cached 0MB) CPU [3%@729,2%@729,0%@729,1%@729,2%@729,0%@729] "
            "EMC_FREQ 2%@1866 GR3D_FREQ 10%@1300 cpu@48.375C soc2@46.906C soc0@46.343C gpu@47.625C tj@48.375C "
            "soc1@46.781C VDD_IN 8563mW/8563mW VDD_CPU_GPU_CV 1510mW/1510mW VDD_SOC 2620mW/2620mW VDD_GPU_SOC 5139mW/5139mW",  # noqa: E501 (a real line, as the tool prints it)
            {
                "ram_used_mb": 4722,
                "gpu_load_ratio": 0.10,
                "gpu_clock_mhz": 1300,
                "gpu_temp": 47.625,
                "VDD_GPU_SOC": 5139,
            },
        ),
        (
            "RAM 9830/125772MB (lfb 23x4MB) SWAP 0/0MB (cached 0MB) CPU [1%@1998,0%@1998] EMC_FREQ 0%@4266 "
            "GR3D_FREQ 12%@[1300,1300] cpu@52.125C gpu@50.093C tj@52.125C VDD_GPU 2012mW/2012mW VIN_SYS_5V0 9011mW/9011mW",  # noqa: E501 (a real line, as the tool prints it)
            {"ram_used_mb": 9830, "gpu_load_ratio": 0.12, "gpu_clock_mhz": 1300, "gpu_temp": 50.093, "VDD_GPU": 2012},
        ),
    ],
    ids=["jetpack5", "jetpack6", "jetpack7"],
)
def test_tegrastats_lines_of_each_jetpack(line, expected):
    parsed = power.parse_tegrastats(line)
    assert parsed["ram_used_mb"] == expected["ram_used_mb"]
    assert parsed["gpu_load_ratio"] == pytest.approx(expected["gpu_load_ratio"])
    assert parsed["gpu_clock_mhz"] == expected["gpu_clock_mhz"]
    assert parsed["temperature_celsius"]["gpu"] == expected["gpu_temp"]
    rail = next(k for k in expected if k.startswith("V"))
    assert parsed["power_mw"][rail] == expected[rail]


@pytest.mark.parametrize("name", BOARDS)
def test_device_telemetry_has_the_shared_keys(as_board, name):
    as_board(name)
    board = BOARDS[name]
    telemetry = JetsonBackend().device_telemetry()
    assert telemetry["power_mode"] == board.power_mode[0]
    assert telemetry["gpu_clock_mhz"] == board.gpu_mhz and telemetry["gpu_load_ratio"] == board.gpu_load
    assert all(isinstance(v, float) for v in telemetry["temperature_celsius"].values())


def prepared(backend, precision, profile):
    """What the engine does with a request: the query (check_request), then the action (prepare_engine)."""
    chosen = backend.check_request(precision, profile)
    backend.prepare_engine(chosen, profile)
    return chosen


def test_profiles_eager_by_default_full_offered():
    backend = JetsonBackend()
    profiles = backend.profiles()
    assert backend.default_profile == "eager" and set(profiles) == {"eager", "basic", "full"}
    eager = profiles["eager"]
    assert not eager.cuda_graphs and eager.chunked_prefill and eager.spec == "ngram" and eager.prefix_caching
    assert eager.max_num_batched_tokens <= 512 and eager.memory_fraction == 0.75
    assert profiles["full"].cuda_graphs and profiles["basic"].spec == "none"


def test_budget_is_a_fraction_of_available_memory_at_start(as_board, monkeypatch):
    state = as_board("orin-nx-16gb-jp5")
    backend = JetsonBackend()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: pytest.fail("cudaMemGetInfo counts page cache as used"))
    prepared(backend, "bf16", backend.profiles()["eager"])
    assert backend.free_memory_bytes() == int(11.2 * GIB * 0.75)
    state["available"] -= 3 * GIB  # weights placed: taken from the budget, not from a new reading
    assert backend.free_memory_bytes() == int(11.2 * GIB * 0.75) - 3 * GIB
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 2 * GIB)  # 1 GiB cached by torch, free to reuse
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: GIB)
    assert backend.free_memory_bytes() == int(11.2 * GIB * 0.75) - 2 * GIB
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: GIB)
    monkeypatch.setenv("FLASHNEXT_MEMORY_FRACTION", "0.5")
    later = JetsonBackend()
    prepared(later, "bf16", resolve_profile(later, None, {}))
    assert later.free_memory_bytes() == int(8.2 * GIB * 0.5)
    assert UnifiedMemory(10 * GIB, 0.75).free(2 * GIB) < 0  # someone else took it: nothing left


def test_check_request_is_a_query_the_budget_and_warnings_come_with_prepare(as_board, capsys):
    as_board("orin-nano-8gb-jp6")  # hot zones: prepare_engine warns
    backend = JetsonBackend()
    for precision in ("bf16", "int4"):
        backend.check_request(precision, backend.profiles()["eager"])
    with pytest.raises(UserError, match="call prepare_engine"):
        backend.free_memory_bytes()  # no budget was started by the queries
    assert capsys.readouterr().err == ""
    prepared(backend, "bf16", backend.profiles()["eager"])
    assert backend.free_memory_bytes() > 0 and "warning: jetson: " in capsys.readouterr().err


def test_fp8_refused_on_orin_with_the_alternatives_allowed_on_thor(as_board):
    as_board("orin-nano-8gb-jp6")
    backend = JetsonBackend()
    for fp8 in ("fp8-e4m3", "fp8-e5m2"):
        with pytest.raises(UserError, match=r"compute capability 8.9 or later.*8\.7: use --precision int4 .* or bf16"):
            backend.check_request(fp8, backend.profiles()["eager"])
    as_board("agx-thor-jp7")
    thor = JetsonBackend()
    assert thor.check_request("fp8-e4m3", thor.profiles()["eager"]).name == "fp8-e4m3"


def test_int4_is_the_default_above_a_billion_parameters():
    backend = JetsonBackend()
    small = {"w": torch.empty(1000, 1000, device="meta")}
    large = {f"w{i}": torch.empty(32000, 4096, device="meta") for i in range(8)}
    assert backend.preferred_precision(small) == "bf16"
    assert backend.preferred_precision(large) == "int4"
    from flashnext.core.precision import int4_quantize

    assert backend.preferred_precision({"w": int4_quantize(torch.randn(8, 128))}) == "int4"  # e.g. a GGUF Q4


def _llama_8b(tiny_llama):
    """Llama-3-8B's shapes on the meta device: sized, never allocated."""
    from flashnext.core.loader import LoadedModel, load_model

    tokenizer = load_model(str(tiny_llama)).tokenizer
    cfg = ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
    )
    shapes = {
        "model.embed_tokens.weight": (128256, 4096),
        "lm_head.weight": (128256, 4096),
        "model.norm.weight": (4096,),
    }
    for i in range(32):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (4096, 4096),
            p + "self_attn.k_proj.weight": (1024, 4096),
            p + "self_attn.v_proj.weight": (1024, 4096),
            p + "self_attn.o_proj.weight": (4096, 4096),
            p + "mlp.gate_proj.weight": (14336, 4096),
            p + "mlp.up_proj.weight": (14336, 4096),
            p + "mlp.down_proj.weight": (4096, 14336),
            p + "input_layernorm.weight": (4096,),
            p + "post_attention_layernorm.weight": (4096,),
        }
    weights = {k: torch.empty(s, dtype=torch.bfloat16, device="meta") for k, s in shapes.items()}
    return LoadedModel(cfg, weights, tokenizer, "llama-3-8b", "llama-3-8b")


@pytest.mark.parametrize(
    "name, precision, fix",
    [
        ("orin-nx-16gb-jp5", "bf16", "use --precision int4"),
        ("orin-nano-8gb-jp6", None, "pick a smaller model"),
    ],
)
def test_a_model_past_the_budget_is_refused_in_one_line(as_board, monkeypatch, tiny_llama, name, precision, fix):
    as_board(name)
    model = _llama_8b(tiny_llama)
    monkeypatch.setattr(JetsonBackend, "load_model", lambda self, source: model)
    args = ["run", "hi", "--backend", "jetson", "--model", "llama-3-8b"]
    args += ["--precision", precision] if precision else []
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = [
        x for x in result.stderr.strip().splitlines() if not x.startswith("warning: jetson: ") and not x.endswith(" s)")
    ]  # 15W on the NX; progress stages
    assert len(lines) == 1 and lines[0].startswith("error: llama-3-8b: its weights and a ") and fix in lines[0]
    assert "fp8" not in lines[0]  # not offered on an Orin
    assert ("as bf16" if precision else "as int4") in lines[0]


@pytest.mark.parametrize("name", [*BOARDS, "broken"])
def test_explain_shows_board_release_power_clock_temperatures_budget(as_board, name):
    as_board(name, props=BOARDS["orin-nano-8gb-jp6"].props if name == "broken" else None)
    result = CliRunner().invoke(app, ["backends", "--explain"])
    assert result.exit_code == 0
    line = next(x for x in result.stdout.splitlines() if x.startswith("jetson: "))
    facts = json.loads(line.removeprefix("jetson: "))
    assert {"board", "power_mode", "gpu_clock", "temperature_celsius", "memory_budget_gib", "warnings"} <= set(facts)
    assert "1-3 GiB more memory" in facts["profiles"]["full"]
    if name in BOARDS:
        assert facts["jetpack"] == BOARDS[name].jetpack and facts["l4t"] == BOARDS[name].l4t
        assert facts["gpu_clock"]["cur_mhz"] == BOARDS[name].gpu_mhz
    else:
        assert facts["unreadable"]
    cuda = next(x for x in result.stdout.splitlines() if x.startswith("cuda: "))
    assert cuda == "cuda: {}"  # cuda refuses the integrated GPU; jetson serves it


@pytest.mark.parametrize(
    "name, said",
    [
        ("orin-nx-16gb-jp5", ["power mode 15W (id 2) is not MAXN"]),
        ("orin-nano-8gb-jp6", ["gpu-thermal is at 91.5 C", "tj-thermal is at 91.5 C"]),
        ("agx-orin-64gb-jp6", []),
    ],
)
def test_power_and_heat_warnings_go_to_stderr_once_at_start(as_board, capsys, name, said):
    as_board(name)
    backend = JetsonBackend()
    for _ in range(2):
        prepared(backend, "int4", backend.profiles()["eager"])
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == len(said) and all(line.startswith("warning: jetson: ") for line in lines)
    assert all(fragment in line for fragment, line in zip(said, lines))


class JetsonOnCpu(JetsonBackend):
    """The jetson backend's kernels, runner and profiles with tensors on the CPU (Triton interpreted). Its weights sit
    in host memory already, as the loader left them: unified memory, so the engine does not count them again."""

    capabilities = JetsonBackend.capabilities.model_copy(update={"unified_memory": True})

    def device(self) -> torch.device:
        return torch.device("cpu")

    def peak_memory_bytes(self, run) -> None:
        return None


@pytest.mark.slow  # the Triton interpreter: tens of seconds on a 2-core machine
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="runs the kernels interpreted on CPU tensors; a GPU runs them "
    "through `flashnext conformance --backend jetson`",
)
def test_eager_profile_generates_what_plain_greedy_decoding_does(tiny_random, monkeypatch):
    """eager runs the CUDA plugin's runner without graphs, with chunked prefill and n-gram drafts verified eagerly:
    greedy tokens equal the plain profile's; its KV cache is sized from the unified budget."""
    pytest.importorskip("triton")
    from flashnext.core.engine.engine import LLMEngine
    from flashnext.core.engine.sequence import SamplingParams

    pretend_board(monkeypatch, "orin-nano-8gb-jp6")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    backend = JetsonOnCpu()
    eager = backend.profiles()["eager"].overridden(max_model_len=128, max_num_batched_tokens=16, block_size=4)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], list(range(20, 40))]  # repeats give the n-gram drafter matches
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs, drafted = {}, {}
    for name, profile in {"eager": eager, "plain": eager.basic()}.items():
        engine = LLMEngine(backend, tiny_random, "fp32", profile)
        seqs = [engine.add_request(p, params) for p in prompts]
        while engine.has_work():
            engine.step()
        outputs[name] = [s.output_ids for s in seqs]
        drafted[name] = engine.spec.stats.drafted if engine.spec else 0
    assert outputs["eager"] == outputs["plain"] and all(len(o) == 8 for o in outputs["eager"])
    assert drafted["eager"] > 0 and drafted["plain"] == 0
    assert engine.blocks.num_blocks == eager.max_num_seqs * 128 // 4  # a 3.7 GiB budget holds every block
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory(8 * GIB, 40_000))  # 30 kB budget
    small = LLMEngine(backend, tiny_random, "fp32", eager)
    block_bytes = 2 * 2 * 2 * 16 * 4 * 4  # K and V, 2 layers, 2 kv heads x 16 dims, 4 tokens, fp32
    assert small.blocks.num_blocks == 30_000 // block_bytes


@pytest.mark.parametrize("name", ["agx-orin-64gb-jp6", "orin-nano-8gb-jp6"])
def test_board_telemetry_becomes_prometheus_gauges(as_board, name):
    from prometheus_client import CollectorRegistry, generate_latest

    from flashnext.core.metrics import device_metrics

    as_board(name)
    board = BOARDS[name]

    class Collector:
        def collect(self):
            return device_metrics(JetsonBackend().device_telemetry())

    registry = CollectorRegistry()
    registry.register(Collector())
    text = generate_latest(registry).decode()
    assert f"flashnext_device_gpu_clock_mhz {float(board.gpu_mhz)}" in text
    assert f"flashnext_device_gpu_load_ratio {float(board.gpu_load)}" in text
    assert f'flashnext_device_power_mode_info{{mode="{board.power_mode[0]}"}} 1.0' in text
    assert 'flashnext_device_temperature_celsius{zone="gpu-thermal"}' in text
