"""DeepSeek-V3 style multi-token prediction (MTP) drafting from the checkpoint's own depth module.

The module at `model.layers.{N}` (N = the target's layer count) maps (hidden state of position p, token p + 1)
to a prediction of token p + 2: enorm(embed(token)) and hnorm(hidden) are concatenated, projected by eh_proj,
run through one decoder block, and read out by shared_head.norm and the target's LM head. Chained K times, its own
output hidden state standing in for the target's, it drafts K tokens.

Its attention needs the module's K/V for every earlier position. They live in a paged cache of their own that
shares the sequences' block tables, so allocation, rollback and preemption need nothing extra: after each target
step the module runs over exactly the positions whose target KV was kept ("catch-up", its last row is the first
draft), and the chained steps write at later positions that the next catch-up overwrites with verified values.
Only the first module is chained (checkpoints with more carry them unused), so its cache is always exact.
"""

from itertools import accumulate

import torch

from ..errors import UserError
from ..kernels import AttentionMetadata
from ..model import DecoderModel, _WeightTaker
from .drafter import DraftRequest


class MtpDrafter:
    def __init__(self, model: DecoderModel, weights: dict, num_blocks: int, block_size: int, kv_dtype: torch.dtype):
        cfg = model.config
        prefix = f"model.layers.{cfg.num_layers}."
        if cfg.num_mtp_modules == 0 or prefix + "eh_proj.weight" not in weights:
            raise UserError(
                "the model has no MTP module (config num_nextn_predict_layers is 0 or"
                f" '{prefix}eh_proj.weight' is missing); use --spec ngram, which needs no extra weights"
            )
        self.model, self.block_size = model, block_size
        take = _WeightTaker(weights, model.device, model.dtype, model.precision)
        self.enorm = take.dense(prefix + "enorm.weight")
        self.hnorm = take.dense(prefix + "hnorm.weight")
        self.eh_proj = take.linear([prefix + "eh_proj.weight"])
        self.head_norm = take.dense(prefix + "shared_head.norm.weight")
        self.block = model._layer(take, prefix)
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=kv_dtype, device=model.device)
        self.v_cache = torch.zeros(shape, dtype=kv_dtype, device=model.device)

    @staticmethod
    def kv_bytes_per_block(model: DecoderModel, block_size: int, kv_dtype: torch.dtype) -> int:
        cfg = model.config
        return 2 * block_size * cfg.num_kv_heads * cfg.head_dim * kv_dtype.itemsize

    def propose(self, requests: list[DraftRequest], hidden: torch.Tensor | None) -> list[list[int]]:
        if hidden is None:  # the runner ran no model this step (it replayed a look-ahead): nothing to catch up from
            return [[] for _ in requests]
        dev = self.model.device
        # Catch-up: position p pairs the target's hidden state at p with the token at p + 1.
        ids, rows, spans = [], [], []
        for r in requests:
            ids += r.seq.token_ids[r.start + 1 : r.start + r.count + 1]
            rows += range(r.first_row, r.first_row + r.count)
            spans.append((r.seq, r.start, r.count))
        out = self._forward(torch.tensor(ids, device=dev), hidden[torch.tensor(rows, device=dev)], spans)
        drafts: list[list[int]] = [[] for _ in requests]
        active = [i for i, r in enumerate(requests) if r.k]
        if not active:
            return drafts
        last_rows = list(accumulate(r.count for r in requests))
        ends = torch.tensor([last_rows[i] - 1 for i in active], device=dev)
        state = out[ends]
        tokens = self._draft(state)
        for step in range(max(requests[i].k for i in active)):
            for i, t in zip(active, tokens.tolist()):
                drafts[i].append(t)
            keep = [j for j, i in enumerate(active) if requests[i].k > step + 1]
            if not keep:
                break
            active = [active[j] for j in keep]
            index = torch.tensor(keep, device=dev)
            spans = [(requests[i].seq, requests[i].start + requests[i].count + step, 1) for i in active]
            state = self._forward(tokens[index], state[index], spans)
            tokens = self._draft(state)
        return drafts

    def _forward(self, token_ids: torch.Tensor, prev_hidden: torch.Tensor, spans) -> torch.Tensor:
        """The depth module over query runs (seq, first position, count); returns its hidden states (pre-norm)."""
        k, m, eps = self.model.kernels, self.model, self.model.config.rms_norm_eps
        x = torch.cat(
            (k.rmsnorm(k.embedding(token_ids, m.embed), self.enorm, eps), k.rmsnorm(prev_hidden, self.hnorm, eps)),
            dim=-1,
        )
        h = k.linear(x, self.eh_proj)
        positions, meta = self._metadata(spans)
        attn = m._attention(
            self.block, k.rmsnorm(h, self.block.input_norm, eps), positions, meta, self.k_cache, self.v_cache
        )
        x, residual = k.add_rmsnorm(attn, h, self.block.post_norm, eps)
        return k.linear(k.silu_and_mul(k.linear(x, self.block.gate_up)), self.block.down) + residual

    def _draft(self, state: torch.Tensor) -> torch.Tensor:
        """Greedy drafts: a point-mass proposal, which the target's own sampler verifies exactly."""
        k = self.model.kernels
        return self.model.compute_logits(k.rmsnorm(state, self.head_norm, self.model.config.rms_norm_eps)).argmax(-1)

    def _metadata(self, spans) -> tuple[torch.Tensor, AttentionMetadata]:
        bs, dev = self.block_size, self.model.device
        positions, slots, query_lens, context_lens = [], [], [], []
        for seq, start, count in spans:
            span = range(start, start + count)
            positions += span
            slots += [seq.block_table[p // bs] * bs + p % bs for p in span]
            query_lens.append(count)
            context_lens.append(start + count)
        tables = [seq.block_table for seq, _, _ in spans]
        meta = AttentionMetadata.from_host(slots, query_lens, context_lens, tables, dev)
        return torch.tensor(positions, dtype=torch.int64, device=dev), meta
