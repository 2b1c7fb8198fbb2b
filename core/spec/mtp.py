"""Multi-token prediction (MTP) drafting from the checkpoint's own depth module.

The module maps (the target's final hidden state at position p, token p + 1) to a prediction of token p + 2: the
token's embedding and the hidden state are normed, concatenated, projected back to the hidden size, run through
one decoder block of the target's architecture, and read out by a norm and the target's LM head. Chained K times,
its own output standing in for the target's hidden state, it drafts K tokens. Two checkpoint layouts (MtpLayout):
DeepSeek-V3's and Xiaomi MiMo's; any other is refused by name.

Its attention needs the module's K/V for every earlier position. They live in a paged cache of their own that
shares the sequences' block tables, so allocation, rollback and preemption need nothing extra: after each target
step the module runs over exactly the positions whose target KV was kept ("catch-up", its last row is the first
draft), and the chained steps write at later positions that the next catch-up overwrites with verified values.
Only the first module is chained (checkpoints with more carry them unused), so its cache is always exact.
"""

from dataclasses import dataclass
from itertools import accumulate

import torch

from ..errors import UserError
from ..kernels import AttentionMetadata
from ..model import DecoderModel, _WeightTaker
from .drafter import DraftRequest


@dataclass(frozen=True)
class MtpLayout:
    """Where a checkpoint keeps its first MTP module and how it combines its inputs."""

    name: str
    prefix: str  # {n}: the target's layer count
    embed_norm: str
    hidden_norm: str
    proj: str  # [hidden, 2 * hidden] over the concatenated, normed inputs
    out_norm: str  # the norm before the LM head
    hidden_first: bool  # concatenation order: hidden state, then embedding (else embedding first)
    chains_normed: bool  # the chained state is the normed output (else the block's output, normed for the head)

    def module_prefix(self, num_layers: int) -> str:
        return self.prefix.format(n=num_layers)


DEEPSEEK_V3 = MtpLayout(
    "DeepSeek-V3", "model.layers.{n}.", "enorm", "hnorm", "eh_proj", "shared_head.norm", False, False
)
MIMO = MtpLayout(
    "MiMo", "model.mtp_layers.0.", "token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm", True, True
)
MTP_LAYOUTS = (DEEPSEEK_V3, MIMO)
# Weight names that mark an MTP module, in a layout above or not.
_MTP_MARKS = ("mtp", "nextn", "eh_proj", "shared_head")


def find_layout(num_layers: int, num_modules: int, weights: dict) -> MtpLayout:
    """The layout of the checkpoint's MTP module; a UserError naming the weights when there is none or it is in a
    layout not read here."""
    known = "; ".join(f"{m.name}: {m.module_prefix(num_layers)}{m.proj}.weight" for m in MTP_LAYOUTS)
    if num_modules:
        for layout in MTP_LAYOUTS:
            if f"{layout.module_prefix(num_layers)}{layout.proj}.weight" in weights:
                return layout
        other = next((name for name in weights if any(mark in name for mark in _MTP_MARKS)), None)
        if other is not None:
            raise UserError(
                f"weight '{other}': an MTP module in a layout flashnext does not read (known: {known}); "
                "use --spec ngram, which needs no extra weights"
            )
    raise UserError(
        "the model has no MTP module (config num_nextn_predict_layers is 0 or none of the weights"
        f" {known} is there); use --spec ngram, which needs no extra weights"
    )


class MtpModule:
    """The checkpoint's first MTP module on the target's device, its projections in the target's precision."""

    def __init__(self, model: DecoderModel, weights: dict):
        cfg = model.config
        self.layout = layout = find_layout(cfg.num_layers, cfg.num_mtp_modules, weights)
        prefix = layout.module_prefix(cfg.num_layers)
        take = _WeightTaker(weights, model.device, model.dtype, model.precision)
        self.model, self.eps = model, cfg.rms_norm_eps
        self.embed_norm = take.dense(prefix + layout.embed_norm + ".weight")
        self.hidden_norm = take.dense(prefix + layout.hidden_norm + ".weight")
        self.proj = take.linear([prefix + layout.proj + ".weight"])
        self.out_norm = take.dense(prefix + layout.out_norm + ".weight")
        self.block = model._layer(take, prefix)

    def block_input(self, kernels, token_ids: torch.Tensor, prev_state: torch.Tensor) -> torch.Tensor:
        """The block's input: the projection of the normed embedding and state, in the layout's order."""
        embedded = kernels.rmsnorm(kernels.embedding(token_ids, self.model.embed), self.embed_norm, self.eps)
        state = kernels.rmsnorm(prev_state, self.hidden_norm, self.eps)
        pieces = (state, embedded) if self.layout.hidden_first else (embedded, state)
        return kernels.linear(torch.cat(pieces, dim=-1), self.proj)

    def chained(self, kernels, out: torch.Tensor) -> torch.Tensor:
        """The state the block's output hands the next chained step (and the first draft's head)."""
        return kernels.rmsnorm(out, self.out_norm, self.eps) if self.layout.chains_normed else out

    def head_input(self, kernels, state: torch.Tensor) -> torch.Tensor:
        """What the LM head reads of a chained state."""
        return state if self.layout.chains_normed else kernels.rmsnorm(state, self.out_norm, self.eps)


class MtpDrafter:
    """Drafting on the host between target steps, from the module's own paged KV cache."""

    def __init__(self, module: MtpModule, num_blocks: int, block_size: int, kv_dtype: torch.dtype):
        model = module.model
        cfg = model.config
        self.module, self.model, self.block_size = module, model, block_size
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

    def _forward(self, token_ids: torch.Tensor, prev_state: torch.Tensor, spans) -> torch.Tensor:
        """The depth module over query runs (seq, first position, count); returns its chained states."""
        k, m, mtp, eps = self.model.kernels, self.model, self.module, self.model.config.rms_norm_eps
        h = mtp.block_input(k, token_ids, prev_state)
        positions, meta = self._metadata(spans)
        attn = m._attention(
            mtp.block, k.rmsnorm(h, mtp.block.input_norm, eps), positions, meta, self.k_cache, self.v_cache
        )
        x, residual = k.add_rmsnorm(attn, h, mtp.block.post_norm, eps)
        return mtp.chained(k, k.linear(k.silu_and_mul(k.linear(x, mtp.block.gate_up)), mtp.block.down) + residual)

    def _draft(self, state: torch.Tensor) -> torch.Tensor:
        """Greedy drafts: a point-mass proposal, which the target's own sampler verifies exactly."""
        return self.model.compute_logits(self.module.head_input(self.model.kernels, state)).argmax(-1)

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
