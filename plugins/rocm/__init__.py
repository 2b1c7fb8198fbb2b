"""The ROCm backend for AMD Instinct and Radeon GPUs on a ROCm build of torch. It runs the CUDA plugin's Triton
kernels and graph runner (HIP implements torch's CUDA API), with ROCm flash attention for prefill where it runs,
FP8 in the target's own format (FNUZ on gfx942, OCP on gfx950), and an HBM clock check before serving."""

import functools
import sys
import time

import torch

from flashnext.core.backend import Backend, Probe
from flashnext.core.errors import UserError
from flashnext.core.hookspecs import hookimpl
from flashnext.core.precision import FP8_MAX
from flashnext.core.profile import Profile, env_overrides
from flashnext.plugins.cuda import CudaBackend

from . import clocks
from .attention import AttentionChoice, FlashAttnPrefill, choose_attention, load_flash_attn
from .device import GFX_TARGETS, OTHER_TARGET, GfxTarget, asic_info, gfx_name, product_name
from .routes import NoInt4Gemv, OwnFormatFp8

SCORE = 110.0  # above cuda's 100, which steps aside on a ROCm torch anyway
TELEMETRY_TTL_S = 2.0  # /health and /metrics share a reading: rocm-smi is a process start each time


class RocmBackend(CudaBackend):
    name = "rocm"
    features = CudaBackend.features | {
        "cuda_graphs": True,  # HIP graphs through torch.cuda.CUDAGraph
        # The shared fp8-e5m2 decode kernel widens bytes with NVIDIA PTX; fp8 KV caches stay off until it has an
        # AMD spelling.
        "fp8_kv_cache": False,
        "flash_attn_prefill": True,  # where flash_attn imports and the target runs it (choose_attention)
    }
    attention_kernels = ("flash_attn", "triton")

    def __init__(self):
        self._attention: AttentionChoice | None = None
        self._clocks_checked = False
        self._device_facts: tuple[str, GfxTarget, str] | None = None
        self._telemetry: tuple[float, clocks.ClockReport] | None = None

    def probe(self) -> Probe:
        hip = torch.version.hip
        if hip is None:
            return Probe(
                False,
                0.0,
                f"this torch is not a ROCm build (torch {torch.__version__}); install torch "
                "from a ROCm wheel index (download.pytorch.org/whl/rocm6.x)",
            )
        if not torch.cuda.is_available():
            return Probe(
                False,
                0.0,
                f"ROCm torch (HIP {hip}) sees no AMD GPU: check access to /dev/kfd and "
                "/dev/dri (video and render groups) and HIP_VISIBLE_DEVICES",
            )
        props = torch.cuda.get_device_properties(0)
        gfx, target, product = self._target()
        fp8 = f"{target.fp8[0]} / {target.fp8[1]}" if target.fp8 else f"none: {gfx} has no FP8"
        try:
            attention = self._choose(self._default_settings(), gfx, target, None)
            attention_facts = {"prefill": attention.prefill, "decode": "triton", "reason": attention.reason}
        except UserError as exc:
            attention_facts = {"error": str(exc)}
        memory = clocks.read_memory_clocks()
        facts = {
            "device": product,
            "gfx_target": gfx,
            "family": target.family,
            "hip": hip,
            "device_count": torch.cuda.device_count(),
            "memory_total_bytes": props.total_memory,
            "compute_units": props.multi_processor_count,
            "fp8": fp8.replace("torch.", ""),
            "attention": attention_facts,
            "memory_clock": memory.as_facts()
            | {
                "idle_reading": memory.summary(),
                "check": "under load before serving: a low clock warns, --strict-clocks refuses to start",
            },
        }
        if target.fp8 is None:  # what `flashnext backends` lists for this machine
            self.precisions = tuple(p for p in self.precisions if p not in FP8_MAX)
        known = "" if target is not OTHER_TARGET else "; not a tested target: bf16 / fp16 / int4 only"
        return Probe(True, SCORE, f"{product} ({gfx}, {target.family}; HIP {hip}){known}", facts)

    def profiles(self) -> dict[str, Profile]:
        full = super().profiles()["full"].overridden(spec="ngram")
        return {"full": full, "basic": full.basic()}

    def kernels(self, precision):
        shared = type(super().kernels(precision))
        # Programmatic dependent launch is NVIDIA's: the shared kernels would enable it from torch's capability,
        # which on ROCm is the gfx number (9.4 on MI300X).
        kernels = rocm_kernels_class(shared)(pdl=False)
        choice = self._attention or self._choose(
            self._default_settings(), *self._target()[:2], self.activation_dtype(precision)
        )
        kernels.flash_attn_varlen_func = load_flash_attn()[0] if choice.prefill == "flash_attn" else None
        return kernels

    def quantized_head(self, precision) -> bool:
        return False  # a quantized head rides the shared kernels' OCP fp8 activations

    def preferred_precision(self, weights: dict) -> str:
        return self.default_precision  # FP8 on AMD runs only when asked for (--precision), see docs/backends.md

    def check_request(self, precision: str, profile: Profile):
        gfx, target, product = self._target()
        if precision in FP8_MAX and target.fp8 is None:
            raise UserError(
                f"{precision} needs FP8 hardware (gfx942: FNUZ, gfx950: OCP); {product} is {gfx}: "
                "use --precision bf16, fp16 or int4"
            )
        chosen = Backend.check_request(self, precision, profile)  # CudaBackend's FP8 test reads CUDA capabilities
        if chosen.name in FP8_MAX:
            chosen = chosen.stored_as(target.fp8[0] if chosen.name == "fp8-e4m3" else target.fp8[1])
        self._choose(profile, gfx, target, self.activation_dtype(chosen))  # refuses a flash_attn that cannot run
        return chosen

    def prepare_engine(self, precision, profile: Profile) -> None:
        gfx, target, _ = self._target()
        self._attention = self._choose(profile, gfx, target, self.activation_dtype(precision))
        self._check_clocks(profile)

    def device_telemetry(self) -> dict:
        """The serving GPU's memory clock, and (in /health) the attention the engine chose and why."""
        if self._telemetry is None or time.monotonic() - self._telemetry[0] > TELEMETRY_TTL_S:
            self._telemetry = time.monotonic(), clocks.read_memory_clocks(clocks.serving_gpu())
        report = self._telemetry[1]
        first = report.clocks[0] if report.clocks else None
        out = {}
        if self._attention is not None:
            out["attention"] = {
                "prefill": self._attention.prefill,
                "decode": "triton",
                "reason": self._attention.reason,
            }
        if first is not None and first.mhz is not None:
            out["memory_clock_mhz"] = first.mhz
        if first is not None and first.max_mhz is not None:
            out["memory_clock_max_mhz"] = first.max_mhz
        return out

    def attention_choice(self) -> AttentionChoice | None:
        """The attention chosen for the running engine (None before prepare_engine)."""
        return self._attention

    def _target(self) -> tuple[str, GfxTarget, str]:
        """(gfx name, its GfxTarget, product name) of GPU 0, read once."""
        if self._device_facts is None:
            props, asic = torch.cuda.get_device_properties(0), asic_info(0)
            gfx = gfx_name(props, asic)
            self._device_facts = gfx, GFX_TARGETS.get(gfx, OTHER_TARGET), product_name(props, asic)
        return self._device_facts

    def _default_settings(self) -> Profile:
        return self.profiles()[self.default_profile].overridden(**env_overrides())

    @staticmethod
    def _choose(profile: Profile, gfx: str, target: GfxTarget, dtype) -> AttentionChoice:
        return choose_attention(profile.attention, gfx, target, dtype)

    def _check_clocks(self, profile: Profile) -> None:
        """Once per engine: warn, or with strict_clocks refuse, when HBM runs below its maximum under load."""
        if self._clocks_checked:
            return
        self._clocks_checked = True
        with clocks.memory_traffic(self.device()):  # only the GPU under that load can tell a clock left low
            report = clocks.read_memory_clocks(clocks.serving_gpu())
        problem = report.problem()
        if problem is None and profile.strict_clocks and not report.readable:
            problem = f"cannot check the HBM clock under load: {report.summary()}"
        if problem and profile.strict_clocks:
            raise UserError(f"{problem}; or start without --strict-clocks (FLASHNEXT_STRICT_CLOCKS)")
        if problem:
            print(f"warning: {problem}", file=sys.stderr)


@functools.cache
def rocm_kernels_class(shared: type) -> type:
    """The shared kernels' class (CudaBackend.kernels builds it) with flash_attn prefill, own-format FP8 and no
    PTX integer dots."""
    return type(f"Rocm{shared.__name__}", (FlashAttnPrefill, OwnFormatFp8, NoInt4Gemv, shared), {})


@hookimpl
def register_backends(register):
    register(RocmBackend())
