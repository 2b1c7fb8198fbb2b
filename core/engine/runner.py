"""Turns a scheduled batch into flat tensors, runs the model and samples on the device."""

from dataclasses import dataclass

import torch

from ..kernels import AttentionMetadata, SamplingTensors, int64_tensor
from ..model import DecoderModel
from .scheduler import ScheduledSeq
from .sequence import Sequence


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # rows of the hidden states whose logits are needed
    sampling: SamplingTensors
    is_decode: bool  # every sequence contributes exactly one token: the shape CUDA graphs capture


class ModelRunner:
    """Generic runner; a backend may subclass it to capture graphs or fuse the step."""

    # A runner may draft and verify by itself (CUDA: on the device); the engine then drafts nothing.
    drafts_itself = False
    # KV slots the engine keeps allocated past each decoding sequence's end, for a runner that runs steps ahead of
    # the engine (CUDA: chunks of decode or verify steps) to fill.
    lookahead_tokens = 0
    # The model's end-of-sequence tokens (the engine sets them): a runner that runs steps ahead may stop a sequence
    # at one on its own.
    eos_ids: frozenset[int] = frozenset()
    # Seconds of one-time work done inside steps so far (CUDA: graph captures, with the kernel compiles in their
    # warm-ups): a report of decode speed leaves them out and names them, as it does the load time.
    warm_up_s = 0.0

    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype):
        cfg = model.config
        self.model, self.block_size, self.device = model, block_size, model.device
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.empty(shape, dtype=kv_dtype, device=self.device), torch.empty(shape, dtype=kv_dtype, device=self.device))
            for _ in range(cfg.num_layers)
        ]

    @staticmethod
    def kv_bytes_per_block(model: DecoderModel, block_size: int, kv_dtype: torch.dtype) -> int:
        cfg = model.config
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * kv_dtype.itemsize

    def run(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits [rows, vocab] float32, sampled token ids [rows]) for the rows each sequence asked for."""
        inputs = self.prepare(batch)
        hidden = self.forward(inputs)
        self.last_hidden = hidden  # final hidden states of every token of the step: the MTP drafter's input
        logits = self.model.compute_logits(hidden[inputs.logit_rows])
        return logits, self.model.kernels.sample(logits, inputs.sampling)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        return self.model.forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)

    def spec_stats(self) -> dict | None:
        """SpecStats.as_dict() of the verify steps a runner that drafts itself ran (None: the engine's count)."""
        return None

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
        """Cache slots of positions start .. start + n: a range a block rather than a lookup a token (with
        int64_tensor, a 64 x 256 prefill's prepare 7.0 -> 2.6 ms on the VM)."""
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
