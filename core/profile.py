"""Engine settings a backend ships as named profiles; env vars and flags override them."""

import os
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from .errors import UserError

MIN_BATCHED_TOKENS = 16  # a prefill chunk shorter than this costs more in launches than it saves in memory

SpecMethod = Literal["none", "ngram", "mtp"]
KvCacheDtype = Literal["auto", "fp8-e5m2", "fp8-e4m3", "bf16", "fp16", "fp32"]


class Profile(BaseModel):
    """Every knob the engine reads. Defaults suit a small CPU deployment; backends ship their own."""

    model_config = {"extra": "forbid"}

    name: str = "basic"
    cuda_graphs: bool = False
    graph_batch_sizes: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    chunked_prefill: bool = False
    prefix_caching: bool = True
    spec: SpecMethod = "none"
    spec_tokens: int = Field(default=4, ge=1, le=16)
    spec_adaptive: bool = True
    # Drafting pauses while more requests than this share a step: a big batch already keeps the GPU busy, and on
    # CUDA the verify step reproduces decode's numbers exactly only up to this batch size (row-invariant kernels).
    spec_max_batch: int = Field(default=8, ge=1, le=4096)
    # The vocabulary projection MTP drafts are read through where the backend drafts on its device: the target's
    # own LM head, or an fp8-e4m3 copy of a 16-bit one (drafts only: verification reads the target's head, so
    # outputs are unchanged; the copy costs vocab x hidden bytes of device memory).
    spec_draft_head: Literal["target", "fp8"] = "target"
    max_num_seqs: int = Field(default=16, ge=1, le=4096)
    max_num_batched_tokens: int = Field(default=1024, ge=MIN_BATCHED_TOKENS)
    max_model_len: int | None = Field(default=None, ge=16)  # None: the model's own context length
    block_size: int = Field(default=16, ge=1, le=1024)
    kv_cache_dtype: KvCacheDtype = "auto"
    memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)  # fraction of free device memory for KV
    # Where the accelerator shares the host's memory (backends that say so): the share of the memory available at
    # start that weights, KV cache and activations may take together.
    memory_fraction: float = Field(default=0.75, gt=0.0, le=1.0)
    kv_cache_max_gib: float | None = Field(default=None, gt=0)  # hard cap, useful on shared hosts and in tests
    # Keep the LM head quantized too: in the weight precision, fp8 for int4 weights (Precision.head; where the
    # backend can: CUDA fp8-e4m3, and int4 with fp8 tensor cores). Faster small-batch decode, worse text: on
    # SmolLM2 fp8 with an fp8 head, Hamlet perplexity 26.43 -> 26.81 (fp32 25.86). Off by default, as llama.cpp
    # and vLLM keep heads at higher precision.
    quantize_lm_head: bool = False
    # The attention kernel, where a backend offers a choice (Backend.attention_kernels): auto lets it pick.
    attention: str = "auto"
    # Refuse to start when the device reports clocks below their maximum under load, or cannot report them; only
    # backends that check clocks before serving read it (in check_request).
    strict_clocks: bool = False
    threads: int | None = Field(default=None, ge=1, le=1024)  # torch CPU threads; None: the idle cores (threads.py)
    # A backend whose graphs are built for short answers caps max_tokens a request: above it, "clamp" runs to the
    # cap (finish_reason "length") and "refuse" rejects the request with the reason.
    max_tokens_cap: int | None = Field(default=None, ge=1)
    max_tokens_over_cap: Literal["clamp", "refuse"] = "clamp"
    # Ranks the model is split across (docs/parallel.md): each holds a shard of every layer and its KV heads.
    tensor_parallel: int = Field(default=1, ge=1, le=256)
    # The collectives' transport: auto is torch's default for the backend's device (NCCL on NVIDIA GPUs, gloo on
    # CPUs); gloo on a GPU runs two ranks on one device (a correctness check: NCCL refuses that).
    tensor_parallel_comm: Literal["auto", "nccl", "gloo"] = "auto"
    # Every row's arithmetic (GEMM path, reduction order, attention split) is fixed whatever else shares the step,
    # so a request's greedy tokens do not depend on its batch. Backends say what it costs them (docs/serving.md).
    batch_invariant: bool = False

    def overridden(self, **changes) -> "Profile":
        """A copy with `changes` applied (None means keep), validated: bad values name the field."""
        data = self.model_dump() | {k: v for k, v in changes.items() if v is not None}
        try:
            return type(self)(**data)  # a backend's Profile subclass keeps its own fields
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"])
            raise UserError(f"profile setting '{field}': {err['msg']} (got {err.get('input')!r})") from None

    def executed_on(self) -> str:
        """Where this profile runs the model, for reports; a backend whose profiles choose a runtime says which."""
        return f"profile '{self.name}'"

    def basic(self) -> "Profile":
        """The rollback switch: no speculative decoding, no graphs, no chunked prefill; prefix caching stays."""
        return self.overridden(name="basic", cuda_graphs=False, chunked_prefill=False, spec="none")


def env_overrides(environ=os.environ, profile_class: type[Profile] = Profile) -> dict:
    """FLASHNEXT_<FIELD>=value for any field of the profile class (e.g. FLASHNEXT_MAX_NUM_SEQS=4); lists are
    comma-separated."""
    out = {}
    for name, field in profile_class.model_fields.items():
        raw = environ.get(f"FLASHNEXT_{name.upper()}")
        if raw is None or name == "name":
            continue
        out[name] = raw.split(",") if "list" in str(field.annotation) else raw
    return out
