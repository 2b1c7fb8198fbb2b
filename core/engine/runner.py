"""The runner contract (a step in, a step result out) and the generic runner over a DecoderModel.

The engine builds one runner from `Backend.runner_class(profile)` with the model `Backend.build_model` returned and
a RunnerSetup, then calls `step` once per scheduled batch. Everything the two exchange is in these types: the engine
never sets a runner's attributes, and reads it only through `step`, `stats`, `lookahead_tokens` and
`device_drafter`. A runner reads the scheduled sequences (token_ids, num_computed, block_table, params, seed,
tokens_left, spec_enabled) and never writes them.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..kernels import AttentionMetadata, SamplingTensors, int64_tensor
from ..model import DecoderModel
from ..spec.drafter import DeviceDrafter
from .scheduler import ScheduledSeq
from .sequence import Sequence

if TYPE_CHECKING:
    from ..spec.mtp import MtpModule


@dataclass(frozen=True)
class RunnerSetup:
    """What the engine hands a runner when it builds one."""

    num_blocks: int  # KV cache blocks (the engine's BlockManager hands them out)
    block_size: int  # tokens a block
    kv_dtype: torch.dtype
    eos_ids: frozenset[int] = frozenset()  # the model's end-of-sequence tokens: a runner running ahead stops there
    mtp: "MtpModule | None" = None  # the checkpoint's MTP module with --spec mtp, for a runner that drafts itself


@dataclass
class StepInput:
    batch: list[ScheduledSeq]
    want_hidden: bool = False  # the engine's drafter reads the step's final hidden states (MTP)


@dataclass
class StepResult:
    sampled: torch.Tensor  # [rows] token ids: each sequence's num_logits rows, in batch order
    logits: torch.Tensor | None = None  # [rows, vocab] float32, where the runner computed them
    hidden: torch.Tensor | None = None  # [T, hidden] final hidden states of every token, when asked for


@dataclass
class RunnerStats:
    """Counters a runner keeps, read by metrics and benchmarks (0 where a runner has no such thing)."""

    graph_captures: int = 0
    graph_replays: int = 0
    graph_memory_bytes: int = 0  # device memory the captures added, outside the KV budget
    # One-time work done inside steps so far (graph captures, with kernel compiles in their warm-ups): a report of
    # decode speed leaves it out and names it, as it does the load time.
    warm_up_s: float = 0.0
    # Where speculative decoding drafts and verifies: "graphs" (inside the runner's captured steps, its device
    # drafter's counters), "" where the engine drafts between steps.
    spec_path: str = ""
    spec_graph_steps: int = 0  # verify steps replayed inside captured graphs


class Runner(ABC):
    """What the engine needs from a backend's forward pass. A runner need not wrap a DecoderModel: a backend that
    runs graphs compiled ahead of time steps its own model object here."""

    # KV slots the engine keeps allocated past each decoding sequence's end (from free blocks only), for a runner
    # that runs steps ahead of the engine and hands back their tokens one step at a time.
    lookahead_tokens: int = 0
    # Set where the runner drafts and verifies inside its own steps: the engine then drafts nothing.
    device_drafter: DeviceDrafter | None = None

    def __init__(self, model, setup: RunnerSetup):
        self.model, self.setup = model, setup

    @abstractmethod
    def step(self, inputs: StepInput) -> StepResult:
        """Run one scheduled batch: write its KV, sample the rows each sequence asked for."""

    def stats(self) -> RunnerStats:
        return RunnerStats()

    def steps_explained(self) -> str | None:
        """How this runner runs steps and why, for `run --explain` (None: nothing beyond the backend's choice)."""
        return None

    @classmethod
    def auto_kv_dtype(cls, model) -> torch.dtype:
        """What `kv_cache_dtype = auto` stores: the model's dtype, unless the runner reads a narrower cache of its
        own choosing."""
        return model.dtype

    @staticmethod
    def kv_bytes_per_block(model, block_size: int, kv_dtype: torch.dtype) -> int:
        """Bytes one KV block takes, for the engine's memory budget."""
        cfg = model.config
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * kv_dtype.itemsize


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # rows of the hidden states whose logits are needed
    sampling: SamplingTensors
    is_decode: bool  # every sequence contributes exactly one token: the shape captured graphs replay


class ModelRunner(Runner):
    """The generic runner: batch -> flat tensors -> DecoderModel -> sampling on the device. A backend may subclass
    it to capture graphs or fuse the step."""

    def __init__(self, model: DecoderModel, setup: RunnerSetup):
        super().__init__(model, setup)
        cfg = model.config
        self.block_size, self.device, self.eos_ids = setup.block_size, model.device, setup.eos_ids
        self.warm_up_s = 0.0
        shape = (setup.num_blocks, setup.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.empty(shape, dtype=setup.kv_dtype, device=self.device),
                torch.empty(shape, dtype=setup.kv_dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]

    def step(self, inputs: StepInput) -> StepResult:
        step = self.prepare(inputs.batch)
        hidden = self.forward(step)
        logits = self.model.compute_logits(hidden[step.logit_rows])
        if logits is None:  # a tensor-parallel rank past the first: rank 0 samples
            return StepResult(step.logit_rows)
        return StepResult(
            self.model.kernels.sample(logits, step.sampling), logits, hidden if inputs.want_hidden else None
        )

    def run(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(logits, sampled) of one step: for tools that read a batch's logits (conformance, numerics)."""
        result = self.step(StepInput(batch))
        return result.logits, result.sampled

    def stats(self) -> RunnerStats:
        return RunnerStats(warm_up_s=self.warm_up_s)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        return self.model.forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)

    def prepare(self, batch: list[ScheduledSeq]) -> StepInputs:
        ids, positions, slots, query_lens, context_lens, rows = [], [], [], [], [], []
        temps, top_ks, top_ps, seeds = [], [], [], []
        for item in batch:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed
            tokens = seq.query_tokens(start, n)
            ids += tokens
            positions += range(start, start + n)
            slots += self._slots(seq, start, n)
            query_lens.append(n)
            context_lens.append(start + n)
            first_row = len(ids) - item.num_logits
            for r in range(item.num_logits):
                rows.append(first_row + r)
                temps.append(seq.params.temperature)
                top_ks.append(seq.params.top_k)
                top_ps.append(seq.params.top_p)
                seeds.append(noise_seed(seq.seed, start + n - item.num_logits + r + 1))
        dev = self.device
        tables = [item.seq.block_table for item in batch]
        meta = AttentionMetadata.from_host(slots, query_lens, context_lens, tables, dev)
        sampling = SamplingTensors(
            temperature=torch.tensor(temps, dtype=torch.float32, device=dev),
            top_k=torch.tensor(top_ks, dtype=torch.int64, device=dev),
            top_p=torch.tensor(top_ps, dtype=torch.float32, device=dev),
            noise_seed=torch.tensor(seeds, dtype=torch.int64, device=dev),
            all_greedy=all(t == 0 for t in temps),
        )
        return StepInputs(
            input_ids=int64_tensor(ids, dev),
            positions=int64_tensor(positions, dev),
            meta=meta,
            logit_rows=torch.tensor(rows, dtype=torch.int64, device=dev),
            sampling=sampling,
            is_decode=len(ids) == len(batch),
        )

    def _slots(self, seq: Sequence, start: int, n: int) -> list[int]:
        """Cache slots of positions start .. start + n: a range a block rather than a lookup a token, as a large
        prefill's prepare runs on the host before every step."""
        if n == 1:  # decode's row
            return [seq.block_table[start // self.block_size] * self.block_size + start % self.block_size]
        slots, position, end = [], start, start + n
        while position < end:
            block, offset = divmod(position, self.block_size)
            first = seq.block_table[block] * self.block_size + offset
            take = min(self.block_size - offset, end - position)
            slots += range(first, first + take)
            position += take
        return slots


def noise_seed(request_seed: int, position: int) -> int:
    """Sampling noise keyed by (request seed, position of the token drawn): batch-independent and repeatable."""
    return (request_seed * 1_000_003 + position) & ((1 << 62) - 1)
