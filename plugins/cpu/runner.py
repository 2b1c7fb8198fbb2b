"""The CPU runner: int4 steps through flashnext's C step or one onnxruntime graph where the model allows it, else the
torch forward."""

import ctypes
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flashnext.core import model_cache
from flashnext.core.engine.runner import ModelRunner, RunnerSetup, StepInput, StepResult
from flashnext.core.errors import UserError
from flashnext.core.model import DecoderModel

from . import native
from .kernels import EXPANDED_DTYPE

if TYPE_CHECKING:  # onnxruntime's graph is imported only where a route runs it (onnx alone is 11 MiB)
    from .ort_graph import OrtModel


@dataclass
class Piece:
    """One sequence's part of a step: its tokens' rows in the step's flat inputs and logits."""

    owner: int  # tells sequences apart (the engine's arrival index)
    index: int  # its sequence's place in the step (its row of the block tables)
    first: int  # its first token's row in the step's inputs
    tokens: int
    past: int  # positions already in the cache
    logits_first: int  # its first logits row in the step's logits
    logits: int  # trailing tokens whose logits are wanted


class CpuRunner(ModelRunner):
    """ModelRunner with the KV cache of all layers in one tensor (the C step reads it as [layers, slots, kv, d]; the
    graph's row cache copies a sequence's positions in with one gather a step), and steps through `NativeModel` or
    `OrtModel` where the model allows it."""

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
        self.graph: OrtModel | None = None
        self.native: native.NativeModel | None = None

    @classmethod
    def auto_kv_dtype(cls, model: DecoderModel) -> torch.dtype:
        """float16 where int4 steps will run through the C step, as llama.cpp keeps its cache: half the memory
        (26 MiB at 1k tokens on SmolLM2), the keys and values rounded once; else the model's dtype."""
        if cls.batch_invariant or cls.int4_route not in ("auto", "native"):  # the graph reads float32 only
            return model.dtype
        return torch.float16 if int4_route(cls.int4_route, model, torch.float16)[0] == "native" else model.dtype

    def step(self, inputs: StepInput) -> StepResult:
        if self.route == "torch" or inputs.want_hidden:  # the graph and the C step hand out logits only
            return super().step(inputs)
        # The step's own torch work (embedding rows, cache copies, sampling) takes microseconds; a wider OpenMP team
        # spins after each op on the cores the graph's pool then needs (SmolLM2 at 2 threads, float32 activations:
        # decode 67-74 -> 73-80 tok/s in paired runs).
        # Built before torch's team is narrowed: the C step's team and the graph's pool take its thread count.
        runs = self._native_model() if self.route == "native" else self._graph()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            step = self.prepare(inputs.batch)
            if self.route == "native":
                logits = self._native_step(runs, pieces(inputs.batch), step)
            else:
                hidden = runs.embed(step.input_ids)
                logits = runs.step(pieces(inputs.batch), hidden, step.meta, self.paged, self.block_size)
            return StepResult(self.model.kernels.sample(logits, step.sampling), logits)
        finally:
            torch.set_num_threads(threads)

    def _native_step(self, model: native.NativeModel, pieces: list[Piece], step) -> torch.Tensor:
        """Logits of the step's wanted rows through the C step: its one-token pieces in calls of up to
        native.MAX_TOKENS, each longer piece (a prompt chunk, a verify step) in calls of that many of its tokens."""
        hidden = model.head.embed(step.input_ids)
        logits = torch.empty(sum(p.logits for p in pieces), model.vocab)
        tables = step.meta.block_tables
        ones = [p for p in pieces if p.tokens == 1]
        for first in range(0, len(ones), native.MAX_TOKENS):
            group = ones[first : first + native.MAX_TOKENS]
            out = torch.empty(len(group), model.vocab)
            rows = [p.first for p in group]
            model.step(
                self.paged,
                self.block_size,
                tables,
                [p.index for p in group],
                [p.past for p in group],
                hidden[rows],
                0,
                out,
            )
            for i, p in enumerate(group):
                if p.logits:
                    logits[p.logits_first] = out[i]
        for p in pieces:
            if p.tokens == 1:
                continue
            wanted_from = p.tokens - p.logits  # the piece's tokens from here on have logits wanted
            for a in range(0, p.tokens, native.MAX_TOKENS):
                b = min(a + native.MAX_TOKENS, p.tokens)
                first_logit = min(max(wanted_from - a, 0), b - a)
                out = logits[p.logits_first + a + first_logit - wanted_from :][: b - a - first_logit]
                model.step(
                    self.paged,
                    self.block_size,
                    tables,
                    [p.index] * (b - a),
                    range(p.past + a, p.past + b),
                    hidden[p.first + a : p.first + b],
                    first_logit,
                    out,
                )
        return logits

    def steps_explained(self) -> str | None:
        if self.model.precision.name != "int4":
            return None
        return f"int4_route {self.route}: {self.route_reason}"

    def _native_model(self) -> native.NativeModel:
        if self.native is None:
            start = time.perf_counter()
            spin_us = native.UNBOUNDED_SPIN_US if self.pool_spin_us is None else self.pool_spin_us
            # Only an MTP drafter asks this route for torch steps (their hidden states).
            self.native = native.NativeModel(self.model, torch.get_num_threads(), spin_us, self.setup.mtp is None)
            release_freed_heap()
            self.warm_up_s += time.perf_counter() - start
        return self.native

    def _graph(self) -> "OrtModel":
        if self.graph is None:
            from . import ort_graph

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


def pieces(batch) -> list[Piece]:
    """The step's sequences as the graph's pieces, in the order `prepare` laid out their tokens and logits rows."""
    out, first, logits_first = [], 0, 0
    for index, item in enumerate(batch):
        seq = item.seq
        piece = Piece(
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
    """(route, why): the C step where it builds here and the choice allows it (`auto`, `native`), else an
    onnxruntime route where the graph can run this model's steps (`auto`: float32 activations; the rounded routes
    change the README's first answer), else torch."""
    if choice == "torch":
        return "torch", "int4_route = torch (profile / FLASHNEXT_INT4_ROUTE)"
    if model.precision.name != "int4":
        return "torch", f"the projections are {model.precision.name}, not int4 (int4_route concerns int4 steps only)"
    reason = None
    if getattr(model, "parallel", None) is not None:  # the graph and the C step hold whole layers: no all-reduce
        reason = "tensor-parallel ranks hold shards of each layer"
    if getattr(model.kernels, "batch_invariant", False):  # both block their products by the number of rows
        reason = "batch_invariant asks for fixed per-row arithmetic"
    missing = None
    if choice in ("auto", "native"):
        missing = reason or native.unavailable(model, kv_dtype)
        if missing is None and choice == "auto" and not native.vectorized():
            missing = "its build has no vector path for this CPU (int4_route = native runs it anyway)"
        if missing is None:
            kv = str(kv_dtype).removeprefix("torch.")
            return "native", f"int4 steps through flashnext's C step built for this CPU, float32 activations, {kv} KV"
        if choice == "native":
            raise UserError(f"int4_route = native cannot run here: {missing}; set int4_route to auto or onnxruntime")
    if reason is None:
        from . import ort_graph

        reason = ort_graph.unsupported(model, kv_dtype)
    if reason is None and choice == "auto":
        acts = ACTIVATIONS_SAID["fp32"]
        return "onnxruntime", f"int4 steps through one onnxruntime MatMulNBits graph, {acts} (no C step: {missing})"
    if reason is None:
        acts = ACTIVATIONS_SAID[ROUTE_ACTIVATIONS[choice]]
        return choice, f"int4 steps through one onnxruntime MatMulNBits graph, {acts}"
    if choice != "auto":
        raise UserError(f"int4_route = {choice} cannot run this model: {reason}; set int4_route to auto or torch")
    return "torch", f"int4 steps through torch: {reason}"
