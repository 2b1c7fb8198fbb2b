"""What a backend plugin provides. Core never names a backend; plugins subclass Backend."""

from dataclasses import dataclass, field

import torch

from .errors import UserError
from .kernels import ReferenceKernels
from .precision import PRECISIONS, Precision
from .profile import Profile


@dataclass
class Probe:
    available: bool
    score: float  # higher wins `--backend auto`; 0 when unavailable
    reason: str  # one human sentence: why (un)available
    facts: dict = field(default_factory=dict)  # device name, memory, capability...


class Backend:
    """Base class: the CPU-style defaults; accelerator backends override what differs."""

    name: str = ""
    precisions: tuple[str, ...] = ()
    default_precision: str = "fp32"
    # Optimizations this backend implements; asking for an undeclared one is refused.
    features: dict[str, bool] = {}
    # Attention kernels a profile may name (Profile.attention) besides auto.
    attention_kernels: tuple[str, ...] = ()

    def probe(self) -> Probe:
        raise NotImplementedError

    def profiles(self) -> dict[str, Profile]:
        base = Profile(name="basic")
        return {"basic": base}

    @property
    def default_profile(self) -> str:
        return next(iter(self.profiles()))

    def device(self) -> torch.device:
        return torch.device("cpu")

    def kernels(self, precision: Precision) -> ReferenceKernels:
        return ReferenceKernels()

    def activation_dtype(self, precision: Precision) -> torch.dtype:
        return precision.activation_dtype

    def head_dtype(self, precision: Precision) -> torch.dtype:
        """Storage of the LM head, the largest single matrix of small models."""
        return self.activation_dtype(precision)

    def quantized_head(self, precision: Precision) -> bool:
        """Whether this backend can store the LM head of `precision` weights quantized, in precision.head (a tied
        one then keeps a copy apart from the embedding table), as the profile's quantize_lm_head asks."""
        return False

    def device_telemetry(self) -> dict:
        """What the device reports now, for /health and /metrics; any subset of: temperature_celsius {zone: float},
        memory_clock_mhz, memory_clock_max_mhz, gpu_clock_mhz, gpu_load_ratio (floats), power_mode (str). Empty where nothing can be read. Other
        keys a backend adds appear in /health only."""
        return {}

    def preferred_precision(self, weights: dict) -> str:
        """The precision used when none is asked for; may depend on how the checkpoint is stored."""
        return self.default_precision

    def free_memory_bytes(self) -> int:
        """Memory the KV cache may draw from, measured after the weights are loaded."""
        raise NotImplementedError

    def peak_memory_bytes(self, run) -> int | None:
        """Memory `run()` needs at its peak beyond what is allocated now, or None (without running it) where the
        device cannot measure it; the engine then sizes the KV cache without a warm-up pass."""
        return None

    def load_model(self, spec: str | None):
        """The model a user names (folder, .gguf, HF id or None for the default), loaded by the core's loader; a
        backend that runs graphs exported ahead of time reads its own folders here."""
        from .loader import load_model

        return load_model(spec)

    def build_model(self, loaded, precision: Precision, profile: Profile, quantized_head: bool):
        """What the runner runs: the core's DecoderModel on this backend's device and kernels, or a backend's own
        model with the same `config`, `dtype` and `device` attributes (its runner_class then runs it)."""
        from .model import DecoderModel

        return DecoderModel(loaded.config, loaded.weights, self.kernels(precision), precision, self.device(),
                            self.activation_dtype(precision), self.head_dtype(precision), quantized_head)

    def runner_class(self, profile: Profile):
        from .engine.runner import ModelRunner

        return ModelRunner

    def check_request(self, precision: str, profile: Profile) -> Precision:
        """Refuse what this backend does not declare, with the reason and the alternatives."""
        if precision not in PRECISIONS:
            raise UserError(f"unknown precision '{precision}': choose one of {', '.join(PRECISIONS)}")
        if precision not in self.precisions:
            raise UserError(
                f"backend '{self.name}' does not support precision '{precision}'"
                f" (supported: {', '.join(self.precisions)})"
            )
        for feature, wanted in (("cuda_graphs", profile.cuda_graphs), ("chunked_prefill", profile.chunked_prefill)):
            if wanted and not self.features.get(feature):
                raise UserError(f"backend '{self.name}' does not implement {feature}; use --profile basic")
        if profile.spec != "none" and not self.features.get("spec_decode"):
            raise UserError(f"backend '{self.name}' does not implement speculative decoding; use --spec none")
        if profile.attention != "auto" and profile.attention not in self.attention_kernels:
            offered = ", ".join(("auto",) + self.attention_kernels)
            raise UserError(f"attention '{profile.attention}' is not offered by backend '{self.name}'"
                            f" (choose {offered}; FLASHNEXT_ATTENTION)")
        return PRECISIONS[precision]


def declares(backend: Backend, feature: str) -> bool:
    """Whether `backend` declares `feature`: the one place the engine and the conformance suite read a declaration."""
    return bool(backend.features.get(feature))
