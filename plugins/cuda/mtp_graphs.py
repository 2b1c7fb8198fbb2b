"""MTP drafting inside the CUDA graphs: the checkpoint's MTP module (core/spec/mtp.py) drafts, its catch-up runs
and its own paged KV cache is written in the captured decode and verify steps, with no host round trip.

A verify step of a spec chunk here: the module's state at the sequence's second-to-last token (position ntok - 2,
kept per KV slot in `states`) gives draft 1 through the LM head; K - 1 chained steps of the module (positions
ntok - 1 on) give drafts 2 .. K; the target verifies the K + 1 rows as the n-gram path does and the engine's
acceptance rule keeps drafts up to the first miss (DeviceVerifier); then the catch-up runs the module over the
positions the target kept, pairing each verify row's final hidden state with the token accepted after it, which
overwrites the chained steps' speculative KV and leaves the state at the new ntok - 2 in `states`. A captured
decode step catches up its one position the same way, and an eager step (prompt chunks, mixed or large batches)
catches up every position it computed, chunk by chunk. So whichever kind of step ran last, the module's cache and
state hold what a run over the whole sequence would compute. States are indexed by KV slot, like the caches,
so a batch that changes between rounds, rollback and preemption need nothing extra.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashnext.core.engine.runner import RunnerSetup
from flashnext.core.kernels import AttentionMetadata
from flashnext.core.model import DecoderModel
from flashnext.core.precision import fp8_quantize
from flashnext.core.profile import Profile
from flashnext.core.spec.adaptive import AcceptanceTracker
from flashnext.core.spec.mtp import MtpModule

from .decode_step import _argmax_token
from .drafting import DeviceVerifier
from .forward import live_rows
from .kernels import CudaKernels
from .primitives import _after_producer, _pow2

# Row counts the eager catch-up runs at once, when a bucket's spec graphs are captured, so no request pays their
# kernels' first use (4-17 ms each, a compile 0.5 s; docs/benchmarks.md): one of each compiled variant of the
# projections' routes (the GEMV unrolls 1 to 4 rows; the skinny GEMM's 16-row tiles to 16 rows, 64-row ones to 64,
# each for counts that are and are not multiples of 16) and cuBLAS at the sizes a retry's catch-up meets (decode
# chunks of 16 positions, waits of 8 to 128 chunks). Other counts above 64 still pay cuBLAS's first call.
WARM_CATCH_UP_ROWS = (1, 2, 3, 4, 15, 16, 32, 63, 128, 255, 512, 1023, 2048)


@triton.jit
def _mtp_plan_kernel(
    hist_ptr,
    ntok_ptr,
    cap_ptr,
    max_pos_ptr,
    tables_ptr,
    req_seed_ptr,
    ids_ptr,
    pos_ptr,
    slot_ptr,
    ctx_ptr,
    seed_ptr,
    n_draft_ptr,
    limit_ptr,
    draft_live_ptr,
    start_ptr,
    state_slot_ptr,
    chain_pos_ptr,
    chain_slot_ptr,
    chain_ctx_ptr,
    chain_stride,
    hist_stride,
    table_stride,
    K: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row j: how many drafts it takes (as the n-gram drafter bounds them, and at most limit[j]: its request's
    adaptive K, 0 while drafting pauses, when draft_live[j] = 0 skips the heads), its K + 1 verify inputs (row r feeds
    the last token, r = 0, or draft r at position ntok - 1 + r; the drafts are written by the chained steps), the
    slot of its module state at ntok - 2, and the inputs of chained step s (position ntok - 2 + s, live while
    draft s + 1 is wanted). n_draft = -1 marks a row that takes no step."""
    _after_producer(PDL)
    j = tl.program_id(0)
    ntok = tl.load(ntok_ptr + j)
    cap = tl.load(cap_ptr + j)
    max_pos = tl.load(max_pos_ptr + j)
    table = tables_ptr + j * table_stride
    active = (ntok < cap) & (ntok - 1 <= max_pos) & (ntok > 1)
    n_draft = tl.minimum(tl.minimum(cap - ntok - 1, max_pos - ntok + 1), tl.load(limit_ptr + j))
    n_draft = tl.where(active, tl.maximum(tl.minimum(n_draft, K), 0), -1)
    r = tl.arange(0, Q_BLOCK)
    live = r <= n_draft
    pos = tl.where(live, ntok - 1 + r, 0)
    block = tl.load(table + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
    slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
    row = j * (K + 1) + r
    q_ok = r <= K
    tl.store(ids_ptr + row, tl.load(hist_ptr + j * hist_stride + tl.maximum(ntok - 1, 0)) + r * 0, mask=q_ok)
    tl.store(pos_ptr + row, pos, mask=q_ok)
    tl.store(slot_ptr + row, tl.where(live, slot, -1), mask=q_ok)
    tl.store(ctx_ptr + row, tl.where(live, pos + 1, 0).to(tl.int32), mask=q_ok)
    seed = tl.load(req_seed_ptr + j)  # the noise key of the token drawn at pos + 1, as the decode step's
    tl.store(seed_ptr + row, (seed * 1_000_003 + pos + 1) & ((1 << 62) - 1), mask=q_ok)
    tl.store(n_draft_ptr + j, n_draft.to(tl.int32))
    tl.store(draft_live_ptr + j, (n_draft > 0).to(tl.int32))
    tl.store(start_ptr + j, ntok)
    state_pos = tl.maximum(ntok - 2, 0)
    state_block = tl.load(table + state_pos // BLOCK_SIZE).to(tl.int64)
    tl.store(state_slot_ptr + j, tl.where(active, state_block * BLOCK_SIZE + state_pos % BLOCK_SIZE, 0))
    # Chained step s = r + 1 sits at the verify position of row r: its KV slot is that row's.
    chain = r + 1 < n_draft
    c_ok = r < K - 1
    tl.store(chain_pos_ptr + r * chain_stride + j, tl.where(chain, pos, 0), mask=c_ok)
    tl.store(chain_slot_ptr + r * chain_stride + j, tl.where(chain, slot, -1), mask=c_ok)
    tl.store(chain_ctx_ptr + r * chain_stride + j, tl.where(chain, pos + 1, 0).to(tl.int32), mask=c_ok)


@triton.jit
def _mtp_catch_up_kernel(
    hist_ptr,
    ntok_ptr,
    start_ptr,
    verify_slot_ptr,
    verify_pos_ptr,
    ids_ptr,
    slot_ptr,
    ctx_ptr,
    hist_stride,
    K: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row j after the verdict: verify row r, at position start - 1 + r, pairs with the token accepted at start + r
    for each r below the tokens taken (ntok - start); later rows compute nothing."""
    _after_producer(PDL)
    j = tl.program_id(0)
    start = tl.load(start_ptr + j)
    take = tl.load(ntok_ptr + j) - start
    r = tl.arange(0, Q_BLOCK)
    row = j * (K + 1) + r
    q_ok = r <= K
    live = r < take
    tok = tl.load(hist_ptr + j * hist_stride + start + r, mask=live & q_ok, other=0)
    tl.store(ids_ptr + row, tok, mask=q_ok)
    tl.store(slot_ptr + row, tl.where(live, tl.load(verify_slot_ptr + row, mask=q_ok, other=-1), -1), mask=q_ok)
    pos = tl.load(verify_pos_ptr + row, mask=q_ok, other=0)
    tl.store(ctx_ptr + row, tl.where(live, pos + 1, 0).to(tl.int32), mask=q_ok)


@triton.jit
def _store_rows_kernel(
    x_ptr, res_ptr, w_ptr, slot_ptr, dst_ptr, D, eps, NORM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """dst[slot[r]] = x[r] + res[r], rmsnormed by w with NORM, for the rows with a slot (>= 0): the sum rounded to the
    activation dtype before the norm, as _rmsnorm_kernel does."""
    _after_producer(PDL)
    r = tl.program_id(0)
    slot = tl.load(slot_ptr + r)
    if slot >= 0:
        d = tl.arange(0, BLOCK)
        m = d < D
        x = tl.load(x_ptr + r * D + d, mask=m, other=0.0).to(tl.float32)
        x = (x + tl.load(res_ptr + r * D + d, mask=m, other=0.0).to(tl.float32)).to(dst_ptr.dtype.element_ty)
        if NORM:
            xf = x.to(tl.float32)
            rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
            x = (xf * rms * tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)).to(dst_ptr.dtype.element_ty)
        tl.store(dst_ptr + slot * D + d, x, mask=m)


@triton.jit
def _block_input_kernel(
    ids_ptr,
    embed_ptr,
    state_ptr,
    res_ptr,
    final_w_ptr,
    embed_w_ptr,
    state_w_ptr,
    out_ptr,
    D,
    eps,
    FINAL: tl.constexpr,
    HIDDEN_FIRST: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row r of the module's block input before its projection: the token's embedding and the previous state, each
    rmsnormed by its weight, side by side in the layout's order (one pass where embedding, two norms and a
    concatenation take four). With FINAL the state is the target's last layer output + residual, which the
    target's final norm (final_w) takes first. Sums and norms rounded to the activation dtype as _rmsnorm_kernel
    rounds them."""
    _after_producer(PDL)
    r = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    m = d < D
    dtype = out_ptr.dtype.element_ty
    tok = tl.load(ids_ptr + r).to(tl.int64)
    e = tl.load(embed_ptr + tok * D + d, mask=m, other=0.0).to(dtype).to(tl.float32)
    e = e * tl.rsqrt(tl.sum(e * e, axis=0) / D + eps) * tl.load(embed_w_ptr + d, mask=m, other=0.0).to(tl.float32)
    h = tl.load(state_ptr + r * D + d, mask=m, other=0.0).to(tl.float32)
    if FINAL:
        h = (h + tl.load(res_ptr + r * D + d, mask=m, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        h = h * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps) * tl.load(final_w_ptr + d, mask=m, other=0.0).to(tl.float32)
        h = h.to(dtype).to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps) * tl.load(state_w_ptr + d, mask=m, other=0.0).to(tl.float32)
    first, second = (h, e) if HIDDEN_FIRST else (e, h)
    tl.store(out_ptr + r * 2 * D + d, first.to(dtype), mask=m)
    tl.store(out_ptr + r * 2 * D + D + d, second.to(dtype), mask=m)


@triton.jit
def _draft_token_kernel(keys_ptr, live_ptr, token_ptr, ids_ptr, ids_stride, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    """Row r's draft from argmax_keys' keys of its logits, into the chained step's input and the verify inputs
    (ids_ptr: the draft's column); 0 for a row not live (its logits were not computed, its draft is never verified)."""
    _after_producer(PDL)
    r = tl.program_id(0)
    keys = tl.load(keys_ptr + r * CHUNKS + tl.arange(0, CHUNKS))[None, :]
    token = tl.sum(_argmax_token(keys), axis=0)
    token = tl.where(tl.load(live_ptr + r) > 0, token, 0)
    tl.store(token_ptr + r, token)
    tl.store(ids_ptr + r * ids_stride, token)


def mtp_forward(
    model: DecoderModel,
    kernels: CudaKernels,
    mtp: MtpModule,
    token_ids: torch.Tensor,
    prev_state: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    caches: tuple[torch.Tensor, torch.Tensor],
    prev_residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The module over a flat batch of rows on the fused kernels (its block as forward_unnormed runs a layer; rows
    whose context length is 0 in a decode-shaped step compute nothing): the block's output and residual, [T, hidden]
    each, whose sum is its output (the kernel after it adds them, with the out norm where it needs one). With
    prev_residual, prev_state + prev_residual is the target's last layer output, which its final norm takes first."""
    cfg, eps, block = model.config, model.config.rms_norm_eps, mtp.block
    live = live_rows(meta)
    h = kernels.linear(block_input(kernels, mtp, token_ids, prev_state, prev_residual), mtp.proj, live=live)
    qkv, residual = kernels.norm_linear(h, None, block.input_norm, eps, block.qkv, live=live)
    if block.qkv_bias is not None:
        qkv = qkv + block.qkv_bias
    attn = kernels.rope_attention(
        qkv,
        block.q_norm,
        block.k_norm,
        eps,
        positions,
        model.cos_sin,
        *caches,
        meta,
        model.scale,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        feeds=block.o,
    )
    out, residual = kernels.linear_into(attn, block.o, residual, block.post_norm, block.gate_up, live=live)
    act, residual = kernels.norm_linear(
        out, residual, block.post_norm, eps, block.gate_up, silu=True, feeds=block.down, live=live
    )
    return kernels.linear_into(act, block.down, residual, None, None, live=live)


def block_input(
    kernels: CudaKernels, mtp: MtpModule, token_ids: torch.Tensor, prev_state: torch.Tensor, prev_residual=None
) -> torch.Tensor:
    """MtpModule.block_input's concatenation of the normed embedding and state, [T, 2 * hidden], in one pass (with
    prev_residual: of the target's final norm of prev_state + prev_residual)."""
    model, dim = mtp.model, prev_state.shape[1]
    out = torch.empty(token_ids.shape[0], 2 * dim, dtype=prev_state.dtype, device=prev_state.device)
    final = prev_residual is not None
    if out.shape[0]:
        _block_input_kernel[(out.shape[0],)](
            token_ids,
            model.embed,
            prev_state.contiguous(),
            prev_residual if final else prev_state,
            model.norm,
            mtp.embed_norm,
            mtp.hidden_norm,
            out,
            dim,
            mtp.eps,
            FINAL=final,
            HIDDEN_FIRST=mtp.layout.hidden_first,
            BLOCK=_pow2(dim),
            **kernels._pdl,
        )
    return out


@dataclass
class MtpTracker(AcceptanceTracker):
    """A request's adaptive rule over its spec chunks (seq.spec_tracker: it lives and ends with the request), and
    the first position whose module entry decode steps left out (None: none; their target states wait in `states`
    at those positions' slots)."""

    behind: int | None = None


class DeviceMtpDrafter(DeviceVerifier):
    """The spec graphs' MTP drafter: the module's chained drafts, catch-ups and paged KV cache, on the device."""

    method = "mtp"
    rule = None

    def __init__(self, model: DecoderModel, setup: RunnerSetup, k: int, rows: int, max_context: int, profile: Profile):
        super().__init__(model.kernels, k)
        cfg, dev = model.config, model.device
        self.adaptive = profile.spec_adaptive
        # The drafts a row may take in the next chunk: its request's adaptive K, 0 while drafting pauses.
        self.host_limit = torch.zeros(rows, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.limit = self.host_limit.to(dev)
        self.draft_live = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.model, self.mtp, self.block_size, self.max_context = model, setup.mtp, setup.block_size, max_context
        self.head = draft_head(model, profile.spec_draft_head)
        shape = (setup.num_blocks, setup.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.caches = (
            torch.zeros(shape, dtype=setup.kv_dtype, device=dev),
            torch.zeros(shape, dtype=setup.kv_dtype, device=dev),
        )
        self.states = torch.zeros(setup.num_blocks * setup.block_size, cfg.hidden_size, dtype=model.dtype, device=dev)
        self.start = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.state_slot = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=dev)  # the latest draft of each row
        chain = max(k - 1, 1)
        self.chain_pos = torch.zeros(chain, rows, dtype=torch.int64, device=dev)
        self.chain_slot = torch.zeros(chain, rows, dtype=torch.int64, device=dev)
        self.chain_ctx = torch.zeros(chain, rows, dtype=torch.int32, device=dev)
        t = rows * (k + 1)
        self.catch_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.catch_slot = torch.zeros(t, dtype=torch.int64, device=dev)
        self.catch_ctx = torch.zeros(t, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(t + 1, dtype=torch.int32, device=dev)

    @staticmethod
    def state_bytes_per_block(model: DecoderModel, block_size: int) -> int:
        """Device memory a KV block's worth of module states takes (the engine's KV budget counts it)."""
        return block_size * model.config.hidden_size * model.dtype.itemsize

    # --- around a spec chunk ---------------------------------------------------------------------------------
    def before_chunk(self, batch) -> None:
        """Each row's drafts for the chunk about to be queued (its request's adaptive K, 0 while paused; the graph's
        width caps it), after the module caught up over the positions decode steps left out."""
        self.before_spec(batch)
        limits = self.host_limit.numpy()
        for j, item in enumerate(batch):
            limits[j] = self._tracker(item.seq).drafts_wanted()
        self.limit[: len(batch)].copy_(self.host_limit[: len(batch)], non_blocking=True)

    def after_chunk(self, batch, row_stats) -> None:
        """A chunk's counters per row (see _spec_accept_kernel) into its request's acceptance."""
        for item, (_, _, drafted, accepted, *_) in zip(batch, row_stats):
            if drafted:
                self._tracker(item.seq).record(int(drafted), int(accepted))

    def before_decode(self, batch) -> None:
        """A decode chunk from each sequence's next position on is queued: its steps keep the target's states and
        leave the module's entries out, until a step that runs the module (before_spec)."""
        for item in batch:
            tracker, start = self._tracker(item.seq), item.seq.num_computed
            tracker.behind = start if tracker.behind is None else min(tracker.behind, start)

    def _tracker(self, seq) -> MtpTracker:
        if not isinstance(seq.spec_tracker, MtpTracker):
            seq.spec_tracker = MtpTracker(k=self.k, k_max=self.k, adaptive=self.adaptive)
        return seq.spec_tracker

    def before_spec(self, batch) -> None:
        """The module over each sequence's positions that decode steps left out (from `behind` to the tokens the
        engine took), in one multi-row step from the target states kept at their slots: afterwards its cache
        holds what catching up step by step would have written. A sequence computed again from before `behind`
        (preemption) only forgets it: the steps that compute it again catch up themselves."""
        spans = []
        for item in batch:
            seq = item.seq
            tracker = self._tracker(seq)
            if tracker.behind is not None and tracker.behind < seq.num_computed:
                spans.append((seq, tracker.behind, seq.num_computed - tracker.behind))
            tracker.behind = None
        if spans:
            ids, positions, meta = self._eager_rows(spans)
            self._catch_up(ids, self.states[meta.slot_mapping], positions, meta)

    def warm_up(self) -> None:
        """The eager catch-up once at each of WARM_CATCH_UP_ROWS rows (those that fit the cache), writing nothing:
        no KV slot, no state slot."""
        blocks = min(self.caches[0].shape[0], -(-self.max_context // self.block_size))
        table, dev = list(range(blocks)), self.model.device
        for n in (n for n in WARM_CATCH_UP_ROWS if n <= blocks * self.block_size):
            meta = AttentionMetadata.from_host([-1] * n, [n], [n], [table], dev)
            ids, positions = torch.zeros(n, dtype=torch.int64, device=dev), torch.arange(n, device=dev)
            self._catch_up(ids, self.states[:n], positions, meta)

    # --- inside a captured verify step ----------------------------------------------------------------------
    def draft(self, state, verify, tables: torch.Tensor, block_size: int) -> None:
        """MTP drafts for every row of `state` (hist, ntok, cap, max_pos, req_seed, n_draft) written as the inputs of
        a K + 1-row verify step (`verify`: ids, positions, slots, ctx, seeds)."""
        hist, ntok, cap, max_pos, req_seed, n_draft = state
        ids, positions, slots, ctx, seeds = verify
        rows, k = hist.shape[0], self.drafts_per_step(ids, hist)
        _mtp_plan_kernel[(rows,)](
            hist,
            ntok,
            cap,
            max_pos,
            tables,
            req_seed,
            ids,
            positions,
            slots,
            ctx,
            seeds,
            n_draft,
            self.limit,
            self.draft_live,
            self.start,
            self.state_slot,
            self.chain_pos,
            self.chain_slot,
            self.chain_ctx,
            self.chain_pos.stride(0),
            hist.stride(0),
            tables.stride(0),
            K=k,
            Q_BLOCK=_pow2(k + 1),
            BLOCK_SIZE=block_size,
            **self.kernels._pdl,
        )
        chained = self.states[self.state_slot[:rows]]
        token = self._greedy(self.mtp.head_input(self.kernels, chained), self.draft_live[:rows], ids[1:], k)
        for s in range(1, k):
            meta = self._meta(self.chain_slot[s - 1, :rows], self.chain_ctx[s - 1, :rows], tables)
            out, residual = self._forward(token, chained, self.chain_pos[s - 1, :rows], meta)
            chained, head_in = self._chained(out, residual)
            token = self._greedy(head_in, meta.context_lens, ids[s + 1 :], k)

    def after_verify(self, hidden, residual, verify, hist, ntok, tables) -> None:
        ids, positions, slots, ctx, seeds = verify
        rows, k = hist.shape[0], self.drafts_per_step(ids, hist)
        t = rows * (k + 1)
        _mtp_catch_up_kernel[(rows,)](
            hist,
            ntok,
            self.start,
            slots,
            positions,
            self.catch_ids,
            self.catch_slot,
            self.catch_ctx,
            hist.stride(0),
            K=k,
            Q_BLOCK=_pow2(k + 1),
            **self.kernels._pdl,
        )
        meta = self._meta(self.catch_slot[:t], self.catch_ctx[:t], tables)
        self._catch_up(self.catch_ids[:t], hidden, positions, meta, residual)

    # --- inside a captured decode step, and after an eager one ------------------------------------------------
    def after_decode(self, hidden, residual, ids, positions, meta) -> None:
        """The step's final hidden states (after the target's last norm) at its positions' slots, for before_spec."""
        self._store(hidden, residual, meta.slot_mapping, self.model.norm)

    def after_eager(self, batch, hidden: torch.Tensor, sampled: torch.Tensor) -> None:
        """Each sequence's computed positions pair with the tokens after them: the prompt's own, then the token
        sampled after its last (a prompt chunk's is the next prompt token); positions decode steps left out
        before them first."""
        self.before_spec(batch)
        spans, fills, picks, row, rows = [], [], [], 0, 0
        for item in batch:
            seq, n = item.seq, item.num_tokens
            row += item.num_logits
            rows += n
            if seq.num_computed + n >= len(seq.token_ids):  # the prompt is in: its last position's token is sampled
                fills.append(rows - 1)
                picks.append(row - 1)
            spans.append((seq, seq.num_computed, n))
        token_ids, positions, meta = self._eager_rows(spans)
        if fills:
            dev = self.model.device
            token_ids[torch.tensor(fills, device=dev)] = sampled[torch.tensor(picks, device=dev)]
        self._catch_up(token_ids, hidden, positions, meta)

    # --------------------------------------------------------------------------------------------------------
    def _eager_rows(self, spans) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids, positions and prefill-shaped metadata of spans (seq, first position, count): position p pairs
        with token p + 1 (0 where it is not known yet: the caller fills it in)."""
        dev, bs = self.model.device, self.block_size
        ids, positions, slots, query_lens, context_lens = [], [], [], [], []
        for seq, start, n in spans:
            known = seq.token_ids[start + 1 : start + n + 1]
            ids += known + [0] * (n - len(known))
            positions += range(start, start + n)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            query_lens.append(n)
            context_lens.append(start + n)
        tables = [seq.block_table for seq, _, _ in spans]
        meta = AttentionMetadata.from_host(slots, query_lens, context_lens, tables, dev)
        token_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        return token_ids, torch.tensor(positions, dtype=torch.int64, device=dev), meta

    def _catch_up(self, token_ids, hidden, positions, meta: AttentionMetadata, residual=None) -> None:
        """The module over positions the target kept (their final hidden states, or with residual the last layer's
        output and residual); each row's chained state lands at its KV slot."""
        out, residual = self._forward(token_ids, hidden, positions, meta, residual)
        self._store(out, residual, meta.slot_mapping, self.mtp.out_norm if self.mtp.layout.chains_normed else None)

    def _store(self, x, residual, slots, norm) -> None:
        """states[slots] = x + residual (rmsnormed by norm, unless None), rows without a slot (-1) left out."""
        if x.shape[0]:
            _store_rows_kernel[(x.shape[0],)](
                x,
                residual,
                norm if norm is not None else x,
                slots,
                self.states,
                x.shape[1],
                self.model.config.rms_norm_eps,
                NORM=norm is not None,
                BLOCK=_pow2(x.shape[1]),
                **self.kernels._pdl,
            )

    def _forward(self, token_ids, prev_state, positions, meta, prev_residual=None) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        return mtp_forward(
            m, self.kernels, self.mtp, token_ids, prev_state, positions, meta, self.caches, prev_residual
        )

    def _chained(self, out, residual) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's output as the next chained step takes it and as the head reads it: one add + norm pass."""
        normed, summed = self.kernels.add_rmsnorm(out, residual, self.mtp.out_norm, self.mtp.eps)
        return (normed if self.mtp.layout.chains_normed else summed), normed

    def _greedy(self, head_in: torch.Tensor, live: torch.Tensor, column: torch.Tensor, k: int) -> torch.Tensor:
        """Greedy drafts (a point-mass proposal, which the target's own sampler verifies exactly) from the head's
        input, written to `column` (every k + 1-th element: a verify input of a step of k drafts) and returned.
        Rows not `live` (0) skip the head where it is the register GEMV (one-sequence graphs); their drafts are 0,
        never verified."""
        rows = head_in.shape[0]
        keys = self.kernels.argmax_keys(self.kernels.linear(head_in, self.head, live=live))
        tokens = self.tokens[:rows]
        _draft_token_kernel[(rows,)](keys, live, tokens, column, k + 1, CHUNKS=keys.shape[1], **self.kernels._pdl)
        return tokens

    def _meta(self, slots, ctx, tables) -> AttentionMetadata:
        """A decode-shaped step: each row attends as a decode row of its own (its context ends at its position)."""
        return AttentionMetadata(
            slot_mapping=slots,
            query_start=self.query_start[: slots.shape[0] + 1],
            context_lens=ctx,
            block_tables=tables,
            max_query_len=1,
            max_context_len=self.max_context,
        )


def draft_head(model: DecoderModel, kind: str):
    """The vocabulary projection drafts are read through: the target's, or with kind "fp8" an fp8-e4m3 copy with a
    scale a row where the target's is 16-bit and the GPU reads fp8 (half the bytes a draft step streams; drafts need
    not be exact, the verify step reads the target's own head)."""
    head = model.lm_head
    sixteen_bit = isinstance(head, torch.Tensor) and head.dtype in (torch.bfloat16, torch.float16)
    if kind == "fp8" and sixteen_bit and reads_fp8(head.device):
        return fp8_quantize(head, "fp8-e4m3", per_channel=True)
    return head


def reads_fp8(device: torch.device) -> bool:
    """Whether the kernels read fp8-e4m3 weights on this device (Ada, Hopper on; the host in tests)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
