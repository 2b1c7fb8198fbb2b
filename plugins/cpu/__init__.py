"""The CPU backend: reference numerics for every precision; the default where no accelerator is found."""

import importlib.util
from typing import Literal

import psutil
import torch

from flashnext.core.backend import API_VERSION, FP8_KV, WIDE_KV, Backend, Capabilities, Probe
from flashnext.core.hookspecs import hookimpl
from flashnext.core.precision import Int4Weight
from flashnext.core.profile import Profile

from .kernels import EXPANDED_DTYPE, CpuKernels
from .native import compilers


class CpuProfile(Profile):
    """The core's knobs plus how int4 steps (prompt chunks and decode steps) run: `native` (decode steps through
    flashnext's own C step, built for this CPU at first use: every layer and the LM head in one call, float32
    activations, the float32 model's numbers; prompt chunks through the onnxruntime graph), `onnxruntime` (one graph
    computing from the 4-bit codes, float32 activations: the reference's numbers but for the 8-bit LM head's rounding),
    `onnxruntime-mlp-int8` (the same graph with the activations into the MLP projections rounded to int8 in blocks
    as llama.cpp's Q4 x Q8 dot does: faster, logits error below llama.cpp's), `onnxruntime-int8` (int8 into every
    projection: the largest error), `torch` (the weights expanded once to fp16), or `auto` (native where a C
    compiler builds it, else onnxruntime where it is installed and the model fits the graph: the rounded routes move
    near-tied tokens, and on the default model they change the README's first answer); env FLASHNEXT_INT4_ROUTE.
    docs/benchmarks.md has each route's speed and logits error."""

    int4_route: Literal["auto", "native", "onnxruntime-mlp-int8", "onnxruntime", "onnxruntime-int8", "torch"] = "auto"

    def executed_on(self) -> str:
        return f"profile '{self.name}', int4_route {self.int4_route}"


class CpuBackend(Backend):
    name = "cpu"
    api_version = API_VERSION
    precisions = ("fp32", "bf16", "fp16", "fp8-e4m3", "fp8-e5m2", "int4")
    default_precision = "fp32"
    capabilities = Capabilities(
        chunked_prefill=True,
        prefix_caching=True,
        drafters=("ngram", "mtp"),
        kv_dtypes=FP8_KV + WIDE_KV,
        unified_memory=True,
    )

    def probe(self) -> Probe:
        facts = {
            "threads": torch.get_num_threads(),
            "memory_available_bytes": psutil.virtual_memory().available,
            "int4_route": int4_route_fact(),
        }
        return Probe(True, 1.0, "the CPU is always there; the lowest score so any accelerator wins", facts)

    def profiles(self) -> dict[str, Profile]:
        # The KV cap keeps a laptop responsive: 2 GiB holds ~45k tokens of the default model in fp32. Prompt chunks
        # of 256 tokens prefill faster than 512 (attention's scores and the MLP's activations stay in cache: SmolLM2
        # int4 at 2 threads 809 vs 753 tok/s, fp32 854 vs 819) and the step's scratch memory is half.
        full = CpuProfile(
            name="full", chunked_prefill=True, max_num_seqs=16, max_num_batched_tokens=256, kv_cache_max_gib=2.0
        )
        return {"full": full, "basic": full.basic()}

    def device(self) -> torch.device:
        return torch.device("cpu")

    def runner_class(self, profile: Profile):
        from .runner import CpuRunner

        settings = {"int4_route": getattr(profile, "int4_route", "auto"), "batch_invariant": profile.batch_invariant}
        return type("CpuRunner", (CpuRunner,), settings)

    def kernels(self, precision):
        return CpuKernels()

    def activation_dtype(self, precision):
        # Quantized weights are expanded to fp32 on the CPU: fp32 GEMMs are the fast path there.
        return precision.activation_dtype if precision.name in ("bf16", "fp16") else torch.float32

    def head_dtype(self, precision):
        # With quantized projections the fp32 LM head would be half of all bytes read per token. An int4 model's
        # tied head stays the embedding itself: the onnxruntime graph reads its own 8-bit codes of it, and the
        # runner makes the fp16 copy only where int4 steps run through torch (54 MiB on the default model).
        if precision.name == "int4" or precision.bits >= 16:
            return self.activation_dtype(precision)
        return EXPANDED_DTYPE

    def preferred_precision(self, weights: dict) -> str:
        # A checkpoint stored in 4 bits (GGUF Q4) runs as int4: same numerics as expanding it to fp32, half the bytes.
        return "int4" if any(isinstance(w, Int4Weight) for w in weights.values()) else self.default_precision


def int4_route_fact() -> str:
    """What `auto` runs int4 steps through on this machine (for --explain; whether the C step builds is known once a
    model loads: the runner says)."""
    if importlib.util.find_spec("onnxruntime") is None:
        return "torch (weights expanded to fp16): onnxruntime is not installed"
    graph = "onnxruntime MatMulNBits, one graph, float32 activations"
    others = "(int4_route: onnxruntime, onnxruntime-mlp-int8, onnxruntime-int8, torch)"
    if compilers():
        return f"decode through the C step built for this CPU, prompts through {graph} {others}"
    return f"{graph}: no C compiler for the C decode step (set CC, or pip install ziglang) {others}"


@hookimpl
def register_backends(register):
    register(CpuBackend())
