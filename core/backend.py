"""What a backend plugin provides. Core never names a backend or a device type; plugins subclass Backend and declare
what they can do in typed Capabilities, and everything the engine needs to know about their device comes from the
methods below (each with a documented default)."""

import platform
from dataclasses import dataclass, field
from typing import Literal

import psutil
import torch
from pydantic import BaseModel, ConfigDict, Field

from .errors import UserError
from .kernels import ReferenceKernels
from .precision import PRECISIONS, Precision, Weight
from .profile import KvCacheDtype, Profile

# The plugin contract's version. A plugin sets `api_version` to the one it was written for; one that sets none was
# written for version 1 (a `features` dict, runners returning (logits, sampled)).
API_VERSION = 2
# What each version changed, in one line: what `flashnext backends` says of a plugin it refuses.
API_CHANGES = {
    2: "capabilities are typed (Backend.capabilities) and runners take a StepInput and return a StepResult",
}
SpecDrafter = Literal["ngram", "mtp"]
FP8_KV: tuple[KvCacheDtype, ...] = ("fp8-e5m2", "fp8-e4m3")
WIDE_KV: tuple[KvCacheDtype, ...] = ("bf16", "fp16", "fp32")


class StaticShapes(BaseModel):
    """The fixed shapes of a backend that runs graphs compiled ahead of time: the engine schedules within them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch: int = Field(ge=1)  # sequences a step always runs (idle rows are padding)
    prefill_chunk: int = Field(ge=1)  # prompt tokens a sequence contributes to one step, at most
    max_context: int = Field(ge=1)  # positions a sequence may reach


class Capabilities(BaseModel):
    """What a backend implements. Asking for what it does not declare is refused with the reason; the engine
    bounds its own settings by the limits declared here."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cuda_graphs: bool = False  # decode steps replay captured graphs (the profile flag of the same name)
    chunked_prefill: bool = False
    prefix_caching: bool = False
    drafters: tuple[SpecDrafter, ...] = ()  # speculative decoding methods (profile `spec`); empty: none
    kv_dtypes: tuple[KvCacheDtype, ...] = ()  # KV cache dtypes it stores besides "auto" (the model's dtype)
    static_shapes: StaticShapes | None = None
    max_concurrency: int | None = Field(default=None, ge=1)  # sequences in flight at once; None: no limit
    max_tokens_per_request: int | None = Field(default=None, ge=2)  # prompt + output; None: the model's context
    unified_memory: bool = False  # the device computes from host memory: loaded weights are already in place
    extra: dict[str, bool] = Field(default_factory=dict)  # backend-specific flags, listed in `features` as given

    @property
    def spec_decode(self) -> bool:
        return bool(self.drafters)

    def features(self) -> dict[str, bool]:
        """The `features` object of `flashnext backends --json` (a public shape), derived from these fields."""
        return {
            "cuda_graphs": self.cuda_graphs,
            "chunked_prefill": self.chunked_prefill,
            "prefix_caching": self.prefix_caching,
            "spec_decode": self.spec_decode,
            "fp8_kv_cache": any(d.startswith("fp8") for d in self.kv_dtypes),
            "static_shapes": self.static_shapes is not None,
            "unified_memory": self.unified_memory,
        } | self.extra

    @classmethod
    def from_features(cls, features: dict[str, bool]) -> "Capabilities":
        """An API 1 plugin's `features` dict read as capabilities (its flags meant every drafter, every fp8 KV
        dtype; 16- and 32-bit KV caches were open to all)."""
        flags = dict(features)
        return cls(
            cuda_graphs=flags.pop("cuda_graphs", False),
            chunked_prefill=flags.pop("chunked_prefill", False),
            prefix_caching=flags.pop("prefix_caching", False),
            drafters=("ngram", "mtp") if flags.pop("spec_decode", False) else (),
            kv_dtypes=(FP8_KV if flags.pop("fp8_kv_cache", False) else ()) + WIDE_KV,
            unified_memory=flags.pop("unified_memory", False),
            extra={k: v for k, v in flags.items() if k != "static_shapes"},  # a flag cannot say which shapes
        )


@dataclass(frozen=True)
class StoredWeight:
    """One projection as a backend holds it, for the conformance suite's storage check. `form` "native": `weight`
    is the precision's own storage (Int4Weight, Fp8Weight, or a tensor of its storage dtype); "grid": `weight` is a
    wider float tensor whose values are exactly the precision's quantized values (an int4 grid of `group_size`
    columns a group, or 16-bit values, carried in a 32-bit graph)."""

    weight: Weight
    form: Literal["native", "grid"] = "native"
    group_size: int | None = None  # "grid" int4: the columns that share one scale and offset


@dataclass
class Probe:
    available: bool
    score: float  # higher wins `--backend auto`; 0 when unavailable
    reason: str  # one human sentence: why (un)available
    facts: dict = field(default_factory=dict)  # device name, memory, capability...


class _Features:
    """A backend's `features` (read on the class or an instance): the flat flags derived from its capabilities."""

    def __get__(self, backend, cls) -> dict[str, bool]:
        return cls.capabilities.features()


class Backend:
    """Base class: defaults for a backend whose device computes from host memory; others override what differs."""

    name: str = ""
    api_version: int | None = None  # the plugin contract it was written for; None: version 1
    precisions: tuple[str, ...] = ()
    default_precision: str = "fp32"
    capabilities: Capabilities = Capabilities()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        declared = cls.__dict__.get("features")
        if isinstance(declared, dict):  # an API 1 plugin: its flags, mapped
            cls.capabilities = Capabilities.from_features(declared)
            del cls.features

    features = _Features()
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
        """Where the model's tensors live. Default: where torch allocates unless told otherwise (host memory)."""
        return torch.get_default_device()

    def device_name(self) -> str:
        """The device in a few words, for benchmark rows. Default: the host processor and torch's thread count."""
        return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"

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
        memory_clock_mhz, memory_clock_max_mhz, gpu_clock_mhz, gpu_load_ratio (floats), power_mode (str). Empty
        where nothing can be read. Other keys a backend adds appear in /health only."""
        return {}

    def preferred_precision(self, weights: dict) -> str:
        """The precision used when none is asked for; may depend on how the checkpoint is stored."""
        return self.default_precision

    def build_model(self, loaded, precision: Precision, profile: Profile, quantized_head: bool):
        """The model the runner steps, built from the loaded checkpoint. Default: a DecoderModel on this backend's
        kernels. A backend that owns its whole forward pass (graphs compiled ahead of time) returns its own object;
        the engine reads only `config`, `device` and `dtype` (the activation dtype, the KV cache's "auto") of it."""
        from .model import DecoderModel

        return DecoderModel(
            loaded.config,
            loaded.weights,
            self.kernels(precision),
            precision,
            self.device(),
            self.activation_dtype(precision),
            self.head_dtype(precision),
            quantized_head,
        )

    def stored_weights(self, model) -> dict[str, StoredWeight]:
        """The projection weights of a model build_model made, as this backend stores them, by "layer I NAME".
        Default: a DecoderModel's layers, each in its native form."""
        return {
            f"layer {i} {name}": StoredWeight(getattr(layer, name))
            for i, layer in enumerate(model.layers)
            for name in ("qkv", "o", "gate_up", "down")
        }

    def load_model(self, spec: str | None):
        """The model a user names (folder, .gguf, HF id or None for the default), loaded by the core's loader; a
        backend that runs graphs exported ahead of time reads its own folders here."""
        from .loader import load_model

        return load_model(spec)

    def runner_class(self, profile: Profile):
        """A class implementing core.engine.runner.Runner; default the generic ModelRunner over a DecoderModel."""
        from .engine.runner import ModelRunner

        return ModelRunner

    # --- memory accounting -------------------------------------------------------------------------------------
    def free_memory_bytes(self) -> int:
        """Memory the KV cache may draw from, measured after the weights are loaded. Default: the host's available
        memory (right where the device computes from host memory)."""
        return psutil.virtual_memory().available

    def peak_memory_bytes(self, run) -> int | None:
        """Memory `run()` (one full-budget prefill step) needs at its peak beyond what is allocated now, or None
        (without running it) where the device cannot measure it; the engine then sizes the KV cache without a
        warm-up pass. Default: None."""
        return None

    def kv_budget_bytes(self, profile: Profile, activation_peak: int) -> float:
        """Bytes the KV cache may take: the profile's share of free memory less a step's activation peak, within
        the profile's cap. A unified-memory device may override it to leave the host its own share."""
        budget = self.free_memory_bytes() * profile.memory_utilization - activation_peak
        if profile.kv_cache_max_gib is not None:
            budget = min(budget, profile.kv_cache_max_gib * (1 << 30))
        return budget

    def reset_memory_peak(self) -> None:
        """Start a new peak for memory_peak_bytes (benchmarks). Default: nothing to reset."""

    def memory_peak_bytes(self) -> int:
        """Peak memory the process used on this device since reset_memory_peak. Default: the process's resident
        memory now (the host cannot track a peak)."""
        return psutil.Process().memory_info().rss

    def synchronize(self) -> None:
        """Wait for queued device work (timing). Default: the work is done when the call returns."""

    # --- requests ----------------------------------------------------------------------------------------------
    def check_request(self, precision: str, profile: Profile) -> Precision:
        """Refuse what this backend does not declare, with the reason and the alternatives; else the Precision it
        runs. A query without side effects: it is also asked what would fit, and before anything is loaded."""
        if precision not in PRECISIONS:
            raise UserError(f"unknown precision '{precision}': choose one of {', '.join(PRECISIONS)}")
        if precision not in self.precisions:
            raise UserError(
                f"backend '{self.name}' does not support precision '{precision}'"
                f" (supported: {', '.join(self.precisions)})"
            )
        caps = self.capabilities
        for feature, wanted, has in (
            ("cuda_graphs", profile.cuda_graphs, caps.cuda_graphs),
            ("chunked_prefill", profile.chunked_prefill, caps.chunked_prefill),
        ):
            if wanted and not has:
                raise UserError(f"backend '{self.name}' does not implement {feature}; use --profile basic")
        if profile.spec != "none" and profile.spec not in caps.drafters:
            has = f" (it drafts with: {', '.join(caps.drafters)})" if caps.drafters else ""
            raise UserError(f"backend '{self.name}' does not implement --spec {profile.spec}{has}; use --spec none")
        if profile.kv_cache_dtype != "auto" and profile.kv_cache_dtype not in caps.kv_dtypes:
            raise UserError(
                f"backend '{self.name}' has no {profile.kv_cache_dtype} KV cache; use --kv-cache-dtype auto"
            )
        if profile.attention != "auto" and profile.attention not in self.attention_kernels:
            offered = ", ".join(("auto",) + self.attention_kernels)
            raise UserError(
                f"attention '{profile.attention}' is not offered by backend '{self.name}'"
                f" (choose {offered}; FLASHNEXT_ATTENTION)"
            )
        return PRECISIONS[precision]

    def prepare_engine(self, precision: Precision, profile: Profile) -> None:
        """The action that follows an accepted request: the engine calls it once, before it loads any weight, with
        what check_request returned and its profile (a memory budget, a kernel choice, a clock check under load
        start here). It may still refuse with a UserError. Default: nothing to prepare."""


def incompatibility(backend: Backend) -> str | None:
    """Why this flashnext cannot run a plugin written for another contract version, in one line (None: it can)."""
    version = backend.api_version or 1
    if version > API_VERSION:
        return f"written for plugin API {version}, newer than this flashnext's API {API_VERSION}: upgrade flashnext"
    if version < API_VERSION and type(backend).runner_class is not Backend.runner_class:
        return (
            f"written for plugin API {version}; API {API_VERSION} changed its runner: "
            f"{API_CHANGES[API_VERSION]} (docs/plugins.md)"
        )
    return None


def declares(backend: Backend, feature: str) -> bool:
    """Whether `backend` declares `feature`: the one place the engine and the conformance suite read a declaration."""
    return bool(backend.features.get(feature))
