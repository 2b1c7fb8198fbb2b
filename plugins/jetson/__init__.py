"""The Jetson backend (AGX Orin, Orin NX, Orin Nano, AGX Thor): the CUDA plugin's kernels and runner on an
integrated GPU that shares the board's memory. Memory is budgeted from what the system has available (the CUDA
driver counts page cache as used there), the default profile runs eager, and the probe reports the board, its power
mode, GPU clock and temperatures.

FLASHNEXT_JETSON_ROOT points the probe at another root (a fixture folder: tests/fixtures/jetson/<board>), and
FLASHNEXT_JETSON_ALLOW_DISCRETE=1 lets a discrete GPU stand in for that board, so the conformance suite and the
benchmarks run on a datacenter GPU (docs/backends.md)."""

import math
import os
import sys
import time
from pathlib import Path

import psutil
import torch

from flashnext.core.backend import Probe
from flashnext.core.errors import UserError
from flashnext.core.hookspecs import hookimpl
from flashnext.core.precision import FP8_MAX, Fp8Weight, Int4Weight
from flashnext.core.profile import Profile, env_overrides
from flashnext.plugins.cuda import CudaBackend

from . import power
from .board import Board, read_board

SCORE = 120.0  # above cuda's 100 on a board (cuda steps aside for integrated GPUs anyway)
DISCRETE_SCORE = 50.0  # a discrete GPU standing in for a board: only when asked for by name
FP8_CAPABILITY = (8, 9)
INT4_ABOVE_PARAMETERS = 1_000_000_000  # larger models default to int4: a quarter of bf16's share of the RAM
TELEMETRY_TTL_S = 2.0  # /health and /metrics share a reading
GIB = 1 << 30
PROFILE_NOTES = {
    "eager": "default: no CUDA graphs, chunked prefill (512-token steps), n-gram speculation, prefix caching",
    "basic": "no graphs, no chunked prefill, no speculation",
    "full": "CUDA graphs for decode: vLLM users on Jetson report 1-3 GiB more memory with graphs",
}


def jetson_root() -> Path:
    return Path(os.environ.get("FLASHNEXT_JETSON_ROOT", "/"))


def discrete_allowed() -> bool:
    return os.environ.get("FLASHNEXT_JETSON_ALLOW_DISCRETE", "") in ("1", "true", "yes")


class UnifiedMemory:
    """The budget on memory the GPU shares with the host: a fraction of what psutil calls available when the
    engine starts, minus what has been taken since (weights, KV cache, activations, by us or anyone)."""

    def __init__(self, available_at_start: int, fraction: float):
        self.available_at_start, self.fraction = available_at_start, fraction

    @property
    def budget(self) -> int:
        return int(self.available_at_start * self.fraction)

    def free(self, available_now: int) -> int:
        return self.budget - max(0, self.available_at_start - available_now)


class JetsonBackend(CudaBackend):
    name = "jetson"
    default_precision = "bf16"
    features = CudaBackend.features | {
        # Captured graphs run on Orin but cost memory the board shares with the OS: offered (profile full), not
        # the default.
        "cuda_graphs": True,
    }

    def __init__(self, root: Path | None = None, run: power.Runner = power.run_command):
        self.root, self.run = root, run
        self.memory: UnifiedMemory | None = None
        self._warned = False
        self._board: Board | None = None
        self._telemetry: tuple[float, dict] | None = None

    @property
    def board(self) -> Board:
        if self._board is None:
            self._board = read_board(self.root or jetson_root())
        return self._board

    def probe(self) -> Probe:
        board = self.board
        facts = board.facts() | self._power_facts() | self._memory_facts()
        if not board.is_tegra:
            return Probe(
                False,
                0.0,
                f"not a Jetson board: {board.root / 'proc/device-tree/compatible'} names no "
                "nvidia,tegra SoC (FLASHNEXT_JETSON_ROOT picks another root)",
                facts,
            )
        if board.family is None:
            return Probe(False, 0.0, f"{board.name}: SoC {board.soc} is not Orin (tegra234) or Thor (tegra264)", facts)
        if not torch.cuda.is_available():
            return Probe(
                False,
                0.0,
                f"torch {torch.__version__} sees no CUDA device (CUDA build: "
                f"{torch.version.cuda or 'none'}): install NVIDIA's torch wheel for JetPack "
                f"{board.jetpack or '?'} (pypi.jetson-ai-lab.io)",
                facts,
            )
        props = torch.cuda.get_device_properties(0)
        major, minor = self.capability()
        facts |= {
            "device": props.name,
            "integrated": bool(props.is_integrated),
            "compute_capability": f"{major}.{minor}",
            "fp8": self._fp8_capable() or f"no: compute capability {major}.{minor} has no FP8 tensor cores",
        }
        if not self._fp8_capable():  # what `flashnext backends` lists for this board
            self.precisions = tuple(p for p in CudaBackend.precisions if p not in FP8_MAX)
        where = (
            f"{board.name} (L4T {board.l4t or '?'}, JetPack {board.jetpack or '?'}; compute capability {major}.{minor})"
        )
        if not props.is_integrated:
            if not discrete_allowed():
                return Probe(
                    False,
                    0.0,
                    f"{props.name} is a discrete GPU; set FLASHNEXT_JETSON_ALLOW_DISCRETE=1 to "
                    f"run it as the board at {board.root} (FLASHNEXT_JETSON_ROOT)",
                    facts,
                )
            return Probe(True, DISCRETE_SCORE, f"{where}, stood in for by discrete {props.name}", facts)
        return Probe(True, SCORE, where, facts)

    def profiles(self) -> dict[str, Profile]:
        # eager: no graph pool and no capture warm-up on memory the OS shares; a small prefill chunk keeps the
        # activation peak low; n-gram drafting runs eagerly (the verify step is an ordinary chunk). The whole
        # budget is memory_fraction (weights + KV + activations), so memory_utilization hands KV all that is left.
        eager = Profile(
            name="eager",
            cuda_graphs=False,
            chunked_prefill=True,
            prefix_caching=True,
            spec="ngram",
            max_num_seqs=16,
            max_num_batched_tokens=512,
            spec_max_batch=4,
            memory_utilization=1.0,
            memory_fraction=0.75,
        )
        # full: decode graphs as on discrete GPUs. vLLM users on Orin report 1-3 GiB more memory with them (in vLLM's
        # and jetson-containers' issue trackers), so the KV cache leaves a share of the budget to the graph pool.
        full = eager.overridden(
            name="full", cuda_graphs=True, graph_batch_sizes=[1, 2, 4, 8, 16], memory_utilization=0.85
        )
        return {"eager": eager, "basic": eager.basic(), "full": full}

    def capability(self) -> tuple[int, int]:
        """The board's compute capability: torch's on a board, the SoC's when a discrete GPU stands in for it."""
        if torch.cuda.is_available() and torch.cuda.get_device_properties(0).is_integrated:
            props = torch.cuda.get_device_properties(0)
            return props.major, props.minor
        return self.board.capability or (0, 0)

    def _fp8_capable(self) -> bool:
        return self.capability() >= FP8_CAPABILITY

    def quantized_head(self, precision) -> bool:
        return precision.name == "fp8-e4m3" or (precision.name == "int4" and self._fp8_capable())

    def preferred_precision(self, weights: dict) -> str:
        """An int4 checkpoint's own precision, and int4 for models over a billion parameters (the RAM is shared with
        the OS); an fp8 checkpoint's own precision where the GPU has FP8 tensor cores; else bf16."""
        stored_fp8 = any(isinstance(w, Fp8Weight) and w.fmt == "fp8-e4m3" for w in weights.values())
        if stored_fp8 and self._fp8_capable():
            return "fp8-e4m3"
        stored_int4 = any(isinstance(w, Int4Weight) for w in weights.values())
        parameters = sum(math.prod(w.shape) for w in weights.values())
        return "int4" if stored_int4 or parameters > INT4_ABOVE_PARAMETERS else self.default_precision

    def check_request(self, precision: str, profile: Profile):
        if precision in FP8_MAX and not self._fp8_capable():
            major, minor = self.capability()
            raise UserError(
                f"{precision} needs FP8 tensor cores (compute capability 8.9 or later); {self.board.name}"
                f" is {major}.{minor}: use --precision int4 (a quarter of bf16's memory) or bf16"
            )
        return super().check_request(precision, profile)

    def prepare_engine(self, precision, profile: Profile) -> None:
        # Each engine prepares before it places anything: its budget starts here.
        self.memory = UnifiedMemory(psutil.virtual_memory().available, profile.memory_fraction)
        self._warn_once()

    def _warn_once(self) -> None:
        """A capped power mode or a zone near its trip point slows decode without failing it: say so at start."""
        if self._warned:
            return
        self._warned = True
        mode, _clock, zones = self._readings()
        for line in power.warnings(mode, zones):
            print(f"warning: jetson: {line}", file=sys.stderr)

    def free_memory_bytes(self) -> int:
        if self.memory is None:
            raise UserError("the jetson backend's memory budget is set when an engine is prepared; call prepare_engine")
        free = self.memory.free(psutil.virtual_memory().available)
        if torch.cuda.is_available():
            if not torch.cuda.get_device_properties(0).is_integrated:  # a stand-in: its own memory bounds it too
                return max(min(free, super().free_memory_bytes()), 0)
            # Blocks torch's caching allocator holds but no tensor uses left the system's available memory, yet
            # are ours to reuse.
            free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        return max(free, 0)

    def device_telemetry(self) -> dict:
        """Temperatures, power mode, GPU clock and load, as far as the board lets them be read."""
        if self._telemetry is None or time.monotonic() - self._telemetry[0] > TELEMETRY_TTL_S:
            self._telemetry = time.monotonic(), self._read_telemetry()
        return self._telemetry[1]

    def _read_telemetry(self) -> dict:
        mode, clock, zones = self._readings()
        out: dict = {}
        if zones:
            out["temperature_celsius"] = {z.name: z.celsius for z in zones}
        if mode is not None:
            out["power_mode"] = mode.name
        if clock is not None and clock.cur_mhz is not None:
            out["gpu_clock_mhz"] = clock.cur_mhz
        if clock is not None and clock.load_ratio is not None:
            out["gpu_load_ratio"] = clock.load_ratio
        return out

    def _readings(self) -> tuple[power.PowerMode | None, power.GpuClock | None, list[power.ThermalZone]]:
        root = self.board.root
        return power.read_power_mode(root, self.run), power.read_gpu_clock(root), power.read_thermal_zones(root)

    def _power_facts(self) -> dict:
        mode, clock, zones = self._readings()
        facts: dict = {"power_mode": f"{mode.name} (id {mode.id})" if mode else "unknown: nvpmodel -q gave nothing"}
        if clock is not None:
            facts["gpu_clock"] = {
                "node": clock.node,
                "cur_mhz": clock.cur_mhz,
                "max_mhz": clock.max_mhz,
                "load_ratio": clock.load_ratio,
            }
        else:
            facts["gpu_clock"] = f"unknown: no {self.board.root}/sys/class/devfreq entry for the GPU"
        facts["temperature_celsius"] = {z.name: z.celsius for z in zones} or "unknown: no readable thermal zone"
        facts["warnings"] = power.warnings(mode, zones)
        return facts

    def _memory_facts(self) -> dict:
        fraction = self.profiles()[self.default_profile].overridden(**env_overrides()).memory_fraction
        memory = psutil.virtual_memory()
        return {
            "profiles": PROFILE_NOTES,
            "memory_total_gib": round(memory.total / GIB, 2),
            "memory_available_gib": round(memory.available / GIB, 2),
            "memory_fraction": fraction,
            "memory_budget_gib": round(UnifiedMemory(memory.available, fraction).budget / GIB, 2),
            "memory_budget": "weights + KV cache + activations, from available system memory (unified)",
        }


@hookimpl
def register_backends(register):
    register(JetsonBackend())
