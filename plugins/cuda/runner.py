"""CUDA graph runner: decode steps replay captured graphs, several steps per host round trip.

The host here is the bottleneck (tens of microseconds per Python-level torch call), so a decode step must not
touch the host: each captured graph reads its inputs from static buffers, samples on the device and writes the
sampled token back as the next step's input (with position, slot and context length derived on the device).
One host round trip then runs up to MAX_DECODE_STEPS steps back to back, bounded by the KV slots the scheduler
already gave each sequence and by its remaining max_tokens; the engine is handed one token per step from that
look-ahead. Sampling noise is keyed by (seed, position), so the look-ahead tokens are exactly the tokens that
step-by-step decoding would draw. Prefill, mixed batches, batches larger than the largest bucket and speculative
verification run eagerly on the same fused kernels.
"""

from dataclasses import dataclass

import numpy as np
import torch

from flashnext.core.engine.runner import ModelRunner, StepInputs
from flashnext.core.engine.scheduler import ScheduledSeq
from flashnext.core.engine.sequence import Sequence
from flashnext.core.kernels import AttentionMetadata, SamplingTensors
from flashnext.core.profile import Profile

from .forward import forward

MAX_DECODE_STEPS = 16
_SEED_MASK = (1 << 62) - 1
# Integer inputs packed in one pinned buffer so a chunk costs one host-to-device copy: rows of _INT_FIELDS.
_INT_FIELDS = ("input_ids", "positions", "valid", "request_seed", "top_k")
_FLOAT_FIELDS = ("temperature", "top_p")


@dataclass
class _Lookahead:
    seqs: list[Sequence]
    start_positions: list[int]
    tokens: np.ndarray  # [steps, batch] sampled tokens
    used: int  # steps already handed to the engine


class CudaGraphRunner(ModelRunner):
    profile: Profile = Profile(name="full", cuda_graphs=True)

    @classmethod
    def for_profile(cls, profile: Profile) -> type["CudaGraphRunner"]:
        """The engine builds runners from a class: bind the profile's graph settings to one."""
        return type(cls.__name__, (cls,), {"profile": profile})

    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype: torch.dtype):
        super().__init__(model, num_blocks, block_size, kv_dtype)
        self.kernels = model.kernels
        self.graph_captures = 0
        self.graph_replays = 0
        self.decode_steps_run = 0  # device decode steps, look-ahead included
        self.max_decode_steps = MAX_DECODE_STEPS  # 1 turns the look-ahead off (same graphs, one step a round trip)
        profile = self.profile
        # Graph decode needs every step's hidden states to stay on the device: not with speculative decoding.
        self.use_graphs = profile.cuda_graphs and profile.spec == "none"
        self.buckets = sorted({b for b in profile.graph_batch_sizes if 0 < b <= profile.max_num_seqs})
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._ahead: _Lookahead | None = None
        if self.use_graphs and self.buckets:
            self._init_static(max(self.buckets))
        else:
            self.use_graphs = False

    def _init_static(self, rows: int) -> None:
        cfg, dev = self.model.config, self.device
        max_len = min(self.profile.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.table_width = -(-max_len // self.block_size)
        self.host_ints = torch.zeros(len(_INT_FIELDS), rows, dtype=torch.int64, pin_memory=True)
        self.host_floats = torch.zeros(len(_FLOAT_FIELDS), rows, dtype=torch.float32, pin_memory=True)
        self.host_tables = torch.zeros(rows, self.table_width, dtype=torch.int32, pin_memory=True)
        self.host_out = torch.zeros(MAX_DECODE_STEPS, rows, dtype=torch.int64, pin_memory=True)
        self.dev_ints = self.host_ints.to(dev)
        self.dev_floats = self.host_floats.to(dev)
        self.dev_tables = self.host_tables.to(dev)
        self.out_tokens = torch.zeros(MAX_DECODE_STEPS, rows, dtype=torch.int64, device=dev)
        self.step_index = torch.zeros(1, dtype=torch.int64, device=dev)
        self.query_start = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        self.pool = torch.cuda.graph_pool_handle()
        self.copy_done = torch.cuda.Event()

    # --- the step ------------------------------------------------------------------------------------------
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        return forward(self.model, self.kernels, inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)

    def run(self, batch: list[ScheduledSeq]):
        if self.use_graphs and self._graphable(batch):
            return None, self._decode(batch)
        self._ahead = None
        return super().run(batch)

    def _graphable(self, batch: list[ScheduledSeq]) -> bool:
        return len(batch) <= self.buckets[-1] and all(i.num_tokens == 1 and i.num_logits == 1 for i in batch)

    def _decode(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        cached = self._take_lookahead(batch)
        if cached is not None:
            return cached
        steps = self._chunk_steps(batch)
        bucket = next(b for b in self.buckets if b >= len(batch))
        greedy = all(item.seq.params.temperature == 0 for item in batch)
        self._fill_inputs(batch, bucket)
        graph = self.graphs.get((bucket, greedy)) or self._capture(batch, bucket, greedy)
        self.step_index.zero_()
        for _ in range(steps):
            graph.replay()
        self.graph_replays += steps
        self.decode_steps_run += steps
        self.host_out.copy_(self.out_tokens, non_blocking=True)
        self.copy_done.record()
        self.copy_done.synchronize()
        tokens = self.host_out.numpy()[:steps, : len(batch)].copy()
        self._ahead = _Lookahead([i.seq for i in batch], [i.seq.num_computed for i in batch], tokens, 1)
        return torch.from_numpy(tokens[0])

    def _take_lookahead(self, batch: list[ScheduledSeq]) -> torch.Tensor | None:
        """The next look-ahead step if this batch is exactly the one that produced it, one step further on."""
        ahead = self._ahead
        if ahead is None or ahead.used >= len(ahead.tokens) or len(batch) != len(ahead.seqs):
            return None
        previous = ahead.tokens[ahead.used - 1]
        for j, item in enumerate(batch):
            seq = item.seq
            if (seq is not ahead.seqs[j] or seq.num_computed != ahead.start_positions[j] + ahead.used
                    or seq.token_ids[-1] != previous[j]):
                return None
        ahead.used += 1
        return torch.from_numpy(ahead.tokens[ahead.used - 1])

    def _chunk_steps(self, batch: list[ScheduledSeq]) -> int:
        """Steps whose KV slots every sequence already owns and whose tokens every sequence still wants."""
        steps = self.max_decode_steps
        for item in batch:
            seq = item.seq
            room = len(seq.block_table) * self.block_size - seq.num_computed
            wanted = seq.params.max_tokens - (len(seq) - seq.num_prompt)
            steps = min(steps, room, wanted)
        return max(steps, 1)

    def _fill_inputs(self, batch: list[ScheduledSeq], bucket: int) -> None:
        ints, floats, tables = self.host_ints.numpy(), self.host_floats.numpy(), self.host_tables.numpy()
        n = len(batch)
        ints[:, :bucket] = 0
        floats[0, :bucket], floats[1, :bucket] = 0.0, 1.0
        for j, item in enumerate(batch):
            seq = item.seq
            ints[:, j] = (seq.token_ids[seq.num_computed], seq.num_computed, 1, seq.seed, seq.params.top_k)
            floats[:, j] = (seq.params.temperature, seq.params.top_p)
            tables[j, : len(seq.block_table)] = seq.block_table
        self.dev_ints.copy_(self.host_ints, non_blocking=True)
        self.dev_floats.copy_(self.host_floats, non_blocking=True)
        self.dev_tables[:n].copy_(self.host_tables[:n], non_blocking=True)

    # --- capture -------------------------------------------------------------------------------------------
    def _splits(self, bucket: int) -> int:
        """KV splits so that a small decode batch still gives the GPU a few hundred attention programs."""
        programs = bucket * self.model.config.num_kv_heads
        splits = 1
        while splits < 16 and programs * splits < 256:
            splits *= 2
        return splits

    def _capture(self, batch, bucket: int, greedy: bool) -> torch.cuda.CUDAGraph:
        self.kernels.decode_splits = self._splits(bucket)
        try:
            # Warm up on a side stream (Triton compiles there), then capture; both leave only the static
            # buffers changed, which are refilled before the replays.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._decode_body(bucket, greedy)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._decode_body(bucket, greedy)
        finally:
            self.kernels.decode_splits = 1
        self.graphs[(bucket, greedy)] = graph
        self.graph_captures += 1
        self._fill_inputs(batch, bucket)
        return graph

    def _decode_body(self, rows: int, greedy: bool) -> None:
        """One decode step on the static buffers: model, sampling, and the next step's inputs, all on device."""
        k = self.kernels
        ids, positions, valid, request_seed, top_k = (self.dev_ints[i, :rows] for i in range(len(_INT_FIELDS)))
        temperature, top_p = self.dev_floats[0, :rows], self.dev_floats[1, :rows]
        tables = self.dev_tables[:rows]
        slots, context_lens = k.decode_inputs(positions, valid, tables, self.block_size)
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start=self.query_start[: rows + 1],
            context_lens=context_lens,
            block_tables=tables,
            max_query_len=1,
            max_context_len=self.table_width * self.block_size,
        )
        hidden = forward(self.model, k, ids, positions, meta, self.kv_caches)
        # 16-bit logits: argmax over them equals argmax over their exact fp32 widening, and sample() widens
        # itself when it needs probabilities, so the [rows, vocab] fp32 copy compute_logits makes is skipped.
        logits = k.linear(hidden, self.model.lm_head)
        seeds = positions if greedy else (request_seed * 1_000_003 + positions + 1) & _SEED_MASK  # unused if greedy
        tokens = k.sample(logits, SamplingTensors(temperature, top_k, top_p, seeds, all_greedy=greedy))
        k.decode_advance(tokens, ids, positions, self.out_tokens, self.step_index)
