"""The CPU runner: int4 steps through one onnxruntime graph where the model allows it, else the torch forward."""

import ctypes
import time

import torch

from flashnext.core import model_cache
from flashnext.core.engine.runner import ModelRunner, RunnerSetup, StepInput, StepResult
from flashnext.core.errors import UserError
from flashnext.core.model import DecoderModel

from . import native, ort_graph
from .kernels import EXPANDED_DTYPE


class CpuRunner(ModelRunner):
    """ModelRunner with the KV cache of all layers in one tensor (so the graph's row cache copies a sequence's
    positions in with one gather a step), and steps through `OrtModel` where the model allows it."""

    int4_route = "auto"  # the profile's choices; set on the subclass CpuBackend.runner_class returns
    batch_invariant = False
    # How long the graph's idle pool threads spin for the next op before they sleep. A layer's ops are microseconds
    # apart: spinning through the gaps saves a wake-up each (SmolLM2 at 2 threads, float32 / int8 activations, tok/s:
    # sleeping 78 / 97, 20 us 87 / 116, unbounded 96 / 119), while a bounded spin leaves a busy neighbour's core
    # alone between steps (with one beside it: 66 / 89, 67 / 87, 45 / 59; docs/benchmarks.md).
    pool_spin_us: int | None = 20

    def __init__(self, model: DecoderModel, setup: RunnerSetup):
        model.kernels.batch_invariant = self.batch_invariant  # before any step: every row's arithmetic is fixed
        super().__init__(model, setup)
        cfg = model.config
        shape = (cfg.num_layers * setup.num_blocks, setup.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = torch.empty(shape, dtype=setup.kv_dtype)
        self.v_cache = torch.empty(shape, dtype=setup.kv_dtype)
        n = setup.num_blocks
        self.kv_caches = [
            (self.k_cache[i * n : (i + 1) * n], self.v_cache[i * n : (i + 1) * n]) for i in range(cfg.num_layers)
        ]
        # Slot s of layer l is row s of that layer's [blocks * block_size, kv heads, head dim].
        slots = n * setup.block_size
        self.paged = tuple(c.view(cfg.num_layers, slots, *shape[2:]) for c in (self.k_cache, self.v_cache))
        self.route, self.route_reason = int4_route(self.int4_route, model, setup.kv_dtype)
        head = model.lm_head
        if self.route == "torch" and model.precision.name == "int4" and getattr(head, "dtype", None) == torch.float32:
            model.lm_head = head.to(EXPANDED_DTYPE)  # torch's int4 steps then read half the head's bytes
        self.graph: ort_graph.OrtModel | None = None

    def step(self, inputs: StepInput) -> StepResult:
        if self.route == "torch" or inputs.want_hidden:  # the graph hands out logits only
            return super().step(inputs)
        graph = self._graph()
        # The step's own torch work (embedding rows, cache copies, sampling) takes microseconds; a wider OpenMP team
        # spins after each op on the cores the graph's pool then needs (SmolLM2 at 2 threads, float32 activations:
        # decode 67-74 -> 73-80 tok/s in paired runs).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            step = self.prepare(inputs.batch)
            hidden = graph.embed(step.input_ids)
            logits = graph.step(pieces(inputs.batch), hidden, step.meta, self.paged, self.block_size)
            return StepResult(self.model.kernels.sample(logits, step.sampling), logits)
        finally:
            torch.set_num_threads(threads)

    def steps_explained(self) -> str | None:
        if self.model.precision.name != "int4":
            return None
        return f"int4_route {self.route}: {self.route_reason}"

    def _graph(self) -> ort_graph.OrtModel:
        if self.graph is None:
            start = time.perf_counter()
            activations = ROUTE_ACTIVATIONS[self.route]
            self.graph = ort_graph.OrtModel(
                self.model,
                torch.get_num_threads(),
                activations,
                self.pool_spin_us,
                # Only an MTP drafter asks this route for torch steps (their hidden states).
                release_model=self.setup.mtp is None,
                constants_folder=model_cache.scratch_folder(),
                native_decode=self.route == "native",
            )
            release_freed_heap()
            self.warm_up_s += time.perf_counter() - start
        return self.graph


def release_freed_heap() -> bool:
    """Hands the heap's free pages back to the system (False where the C library is not glibc). glibc keeps what
    large temporaries freed for reuse; after the graph build (the LM head's codes made in chunks, onnxruntime's
    prepacking) that is ~50 MiB on SmolLM2 that nothing later reuses (docs/benchmarks.md)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):  # no malloc_trim, or no process-wide symbol lookup (Windows)
        return False
    trim(0)
    return True


def pieces(batch) -> list[ort_graph.Piece]:
    """The step's sequences as the graph's pieces, in the order `prepare` laid out their tokens and logits rows."""
    out, first, logits_first = [], 0, 0
    for index, item in enumerate(batch):
        seq = item.seq
        piece = ort_graph.Piece(
            owner=seq.arrival_index,
            index=index,
            first=first,
            tokens=item.num_tokens,
            past=seq.num_computed,
            logits_first=logits_first,
            logits=item.num_logits,
        )
        out.append(piece)
        first += item.num_tokens
        logits_first += item.num_logits
    return out


# What each onnxruntime route rounds to int8 (ort_graph.ROUNDED), and how `run --explain` says it.
ROUTE_ACTIVATIONS = {
    "native": "fp32",
    "onnxruntime": "fp32",
    "onnxruntime-mlp-int8": "mlp-int8",
    "onnxruntime-int8": "int8",
}
ACTIVATIONS_SAID = {
    "fp32": "float32 activations",
    "mlp-int8": "int8 activations into the MLP projections, float32 into attention's",
    "int8": "int8 activations",
}


def int4_route(choice: str, model: DecoderModel, kv_dtype: torch.dtype) -> tuple[str, str]:
    """(route, why): the C decode step where it builds here and the choice allows it (`auto`, `native`), else an
    onnxruntime route where the graph can run this model's steps (`auto`: float32 activations; the rounded routes
    change the README's first answer), else torch."""
    if choice == "torch":
        return "torch", "int4_route = torch (profile / FLASHNEXT_INT4_ROUTE)"
    if model.precision.name != "int4":
        return "torch", f"the projections are {model.precision.name}, not int4 (int4_route concerns int4 steps only)"
    reason = ort_graph.unsupported(model, kv_dtype)  # the native route prefills through the graph too
    if getattr(model, "parallel", None) is not None:  # the graph holds whole layers: no all-reduce between ranks
        reason = "tensor-parallel ranks hold shards of each layer"
    if getattr(model.kernels, "batch_invariant", False):  # onnxruntime's GEMMs block by the number of rows
        reason = "batch_invariant asks for fixed per-row arithmetic"
    if reason is None and choice in ("auto", "native"):
        missing = native.unavailable(model)
        if missing is None and choice == "auto" and not native.vectorized():
            missing = "its build has no vector path for this CPU (int4_route = native runs it anyway)"
        if missing is None:
            return "native", (
                "int4 decode steps through flashnext's C step built for this CPU, float32 activations; prompt chunks"
                " through one onnxruntime MatMulNBits graph, float32 activations"
            )
        if choice == "native":
            raise UserError(f"int4_route = native cannot run here: {missing}; set int4_route to auto or onnxruntime")
        acts = ACTIVATIONS_SAID["fp32"]
        return "onnxruntime", f"int4 steps through one onnxruntime MatMulNBits graph, {acts} (no C step: {missing})"
    if reason is None:
        acts = ACTIVATIONS_SAID[ROUTE_ACTIVATIONS[choice]]
        return choice, f"int4 steps through one onnxruntime MatMulNBits graph, {acts}"
    if choice != "auto":
        raise UserError(f"int4_route = {choice} cannot run this model: {reason}; set int4_route to auto or torch")
    return "torch", f"int4 steps through torch: {reason}"
