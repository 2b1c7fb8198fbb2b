"""Speculative decoding on the device: n-gram drafts and their verdicts as Triton kernels, so the verify steps of a
spec chunk chain inside captured graphs without the host. DeviceNgramDrafter is the runner's DeviceDrafter
(core/spec/drafter.py): core's NgramRule and acceptance rule, on the device."""

import numpy as np
import torch
import triton
import triton.language as tl

from flashnext.core.spec.decoder import SpecStats
from flashnext.core.spec.drafter import NGRAM_RULE

from .decode_step import _argmax_token, _key_chunks
from .kernels import CudaKernels
from .primitives import _after_producer, _pow2

# A spec row's counters (_spec_accept_kernel) before its per-position ones: verify steps, steps with drafts, drafted,
# accepted.
SPEC_STAT_FIELDS = 4
# Tokens a spec row stops at on the device (its EOS and stop tokens; -1 pads): past one, the chunk's remaining
# steps find the row finished, and a step with every row finished costs less than one that verifies
# (docs/backends.md).
SPEC_STOP_IDS = 8


@triton.jit
def _ngram_hit(hist, ntok, n, MAX_N: tl.constexpr, K: tl.constexpr, SCAN: tl.constexpr):
    """(start of the latest earlier copy of the last n tokens with K tokens after it, else of the earliest copy,
    else -1): the choice NgramDrafter.lookup makes. A copy must end before the last token (a token follows it)."""
    latest_whole = tl.full([], -1, tl.int64)
    earliest = tl.full([], 1 << 40, tl.int64)
    for base in range(0, ntok, SCAN):
        i = base + tl.arange(0, SCAN).to(tl.int64)
        hit = i + n < ntok  # (so ntok > n too)
        for back in tl.static_range(MAX_N):  # the first n tokens of the copy must equal the suffix
            suffix = tl.load(hist + tl.maximum(ntok - n + back, 0))  # hits need ntok > n: then in range
            same = tl.load(hist + i + back, mask=hit & (i + back < ntok), other=-1) == suffix
            hit = hit & (same | (i * 0 + back >= n))
        latest_whole = tl.maximum(latest_whole, tl.max(tl.where(hit & (i + n + K <= ntok), i, -1), axis=0))
        earliest = tl.minimum(earliest, tl.min(tl.where(hit, i, 1 << 40), axis=0))
    return tl.where(latest_whole >= 0, latest_whole, tl.where(earliest < (1 << 40), earliest, -1))


@triton.jit
def _spec_draft_kernel(
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
    hist_stride,
    table_stride,
    K: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    MIN_N: tl.constexpr,
    MAX_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SCAN: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row j: drafts from its own history (prompt lookup, longest n-gram first) and its K + 1 verify inputs.

    Row r of the verify step feeds token hist[ntok - 1] (r = 0) or draft r - 1 at position ntok - 1 + r. Rows past
    the drafts, past the sequence's writable slots (max_pos) or of a finished sequence (ntok = cap) write no KV and
    attend to nothing; n_draft = -1 marks a row that takes no step at all."""
    _after_producer(PDL)
    j = tl.program_id(0)
    hist = hist_ptr + j * hist_stride
    ntok = tl.load(ntok_ptr + j)
    cap = tl.load(cap_ptr + j)
    max_pos = tl.load(max_pos_ptr + j)
    start = tl.full([], -1, tl.int64)
    n_hit = tl.full([], 0, tl.int64)
    for back in tl.static_range(MAX_N - MIN_N + 1):
        n = MAX_N - back
        hit = _ngram_hit(hist, ntok, n, MAX_N, K, SCAN)
        take = (start < 0) & (hit >= 0)
        start = tl.where(take, hit, start)
        n_hit = tl.where(take, n, n_hit)
    active = (ntok < cap) & (ntok - 1 <= max_pos) & (ntok > 0)
    n_draft = tl.where(start >= 0, tl.minimum(ntok - start - n_hit, K), 0)
    n_draft = tl.maximum(tl.minimum(n_draft, tl.minimum(cap - ntok - 1, max_pos - ntok + 1)), 0)
    n_draft = tl.where(active, n_draft, -1)  # an inactive row verifies nothing, its own token included
    r = tl.arange(0, Q_BLOCK)
    q_ok = r <= K
    live = r <= n_draft
    last = tl.load(hist + tl.maximum(ntok - 1, 0))
    draft = tl.load(hist + start + n_hit + r - 1, mask=live & (r > 0), other=0)
    pos = tl.where(live, ntok - 1 + r, 0)
    block = tl.load(tables_ptr + j * table_stride + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
    row = j * (K + 1) + r
    tl.store(ids_ptr + row, tl.where(r > 0, tl.where(live, draft, last), last), mask=q_ok)
    tl.store(pos_ptr + row, pos, mask=q_ok)
    tl.store(slot_ptr + row, tl.where(live, block * BLOCK_SIZE + pos % BLOCK_SIZE, -1), mask=q_ok)
    tl.store(ctx_ptr + row, tl.where(live, pos + 1, 0).to(tl.int32), mask=q_ok)
    # The noise key of the token drawn at position pos + 1, as the decode step computes it.
    seed = tl.load(req_seed_ptr + j)
    tl.store(seed_ptr + row, (seed * 1_000_003 + pos + 1) & ((1 << 62) - 1), mask=q_ok)
    tl.store(n_draft_ptr + j, n_draft.to(tl.int32))


@triton.jit
def _spec_accept_kernel(
    sampled_ptr,
    ids_ptr,
    hist_ptr,
    ntok_ptr,
    cap_ptr,
    n_draft_ptr,
    stats_ptr,
    stop_ptr,
    hist_stride,
    stats_stride,
    STAT_FIELDS: tl.constexpr,
    K: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
    STOPS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row j: drafts up to the first that differs from the target's own sample are accepted; the samples (the
    accepted drafts and the token after them) extend the history, up to the first of the row's stop tokens
    (stop_ptr[j]), which also ends the row (cap). stats[j]: steps, steps with drafts (a history with no n-gram to
    copy verifies none), drafted, accepted (drafts that became tokens), then the accepted count at each draft
    position. CHUNKS > 0: sampled_ptr holds argmax_keys' keys (a greedy step)."""
    _after_producer(PDL)
    j = tl.program_id(0)
    n_draft = tl.load(n_draft_ptr + j)
    if n_draft >= 0:
        ntok = tl.load(ntok_ptr + j)
        cap = tl.load(cap_ptr + j)
        r = tl.arange(0, Q_BLOCK)
        if CHUNKS > 0:
            c = tl.arange(0, CHUNKS)
            sampled = _argmax_token(
                tl.load(sampled_ptr + (j * (K + 1) + r[:, None]) * CHUNKS + c[None, :], mask=(r <= K)[:, None], other=0)
            )
        else:
            sampled = tl.load(sampled_ptr + j * (K + 1) + r, mask=r <= K, other=0)
        draft = tl.load(ids_ptr + j * (K + 1) + r + 1, mask=r < K, other=0)
        miss = (r >= n_draft) | (draft != sampled)
        n_acc = tl.min(tl.where(miss, r, Q_BLOCK), axis=0)
        stops = tl.load(stop_ptr + j * STOPS + tl.arange(0, STOPS))
        is_stop = tl.max((sampled[:, None] == stops[None, :]).to(tl.int32), axis=1) > 0
        first_stop = tl.min(tl.where(is_stop, r, Q_BLOCK), axis=0)
        take = tl.minimum(tl.minimum(n_acc, first_stop) + 1, cap - ntok)
        tl.store(hist_ptr + j * hist_stride + ntok + r, sampled, mask=r < take)
        tl.store(ntok_ptr + j, ntok + take)
        tl.store(cap_ptr + j, tl.where(first_stop < take, ntok + take, cap))
        stats = stats_ptr + j * stats_stride
        tl.store(stats, tl.load(stats) + 1)
        tl.store(stats + 1, tl.load(stats + 1) + (n_draft > 0))
        tl.store(stats + 2, tl.load(stats + 2) + n_draft)
        tl.store(stats + 3, tl.load(stats + 3) + take - 1)
        per_position = stats + STAT_FIELDS + r
        tl.store(per_position, tl.load(per_position, mask=r < K, other=0) + (r < take - 1), mask=r < K)


class DeviceVerifier:
    """What every drafter of the spec graphs shares: the engine's acceptance rule inside each captured verify step,
    its counters in the engine's shape, and the hooks a drafter with state of its own (MTP) runs after each kind of
    step; drafting by prompt lookup reads the history alone, so there they do nothing."""

    def __init__(self, kernels: CudaKernels, k: int):
        self.kernels, self.k = kernels, k  # k: the widest graph's drafts a step
        self.totals = np.zeros(SPEC_STAT_FIELDS + k, dtype=np.int64)  # see _spec_accept_kernel

    @staticmethod
    def drafts_per_step(ids: torch.Tensor, hist: torch.Tensor) -> int:
        """K of a verify step: its ids hold K + 1 rows for each of hist's sequences (a probe's graph is narrower
        than the widest)."""
        return ids.shape[0] // hist.shape[0] - 1

    def accept(self, sampled, ids, hist, ntok, cap, n_draft, stats, stops) -> None:
        """Drafts up to the first that differs from the target's sample, then the sample, onto the history.
        sampled: [rows * (k + 1)] tokens, or argmax_keys' [rows * (k + 1), chunks] keys of a greedy step;
        stops: [rows, SPEC_STOP_IDS] each row's stop tokens, -1 padded."""
        k = self.drafts_per_step(ids, hist)
        _spec_accept_kernel[(hist.shape[0],)](
            sampled,
            ids,
            hist,
            ntok,
            cap,
            n_draft,
            stats,
            stops,
            hist.stride(0),
            stats.stride(0),
            STAT_FIELDS=SPEC_STAT_FIELDS,
            K=k,
            Q_BLOCK=_pow2(k + 1),
            CHUNKS=_key_chunks(sampled),
            STOPS=stops.shape[1],
            **self.kernels._pdl,
        )

    def stats(self) -> SpecStats:
        """drafts counts the verify steps that carried a draft (a step whose history had no n-gram to copy
        verified none), as the engine's own drafter counts."""
        drafts, drafted, accepted = (int(x) for x in self.totals[1:SPEC_STAT_FIELDS])
        return SpecStats(drafts, drafted, accepted, self.totals[SPEC_STAT_FIELDS:].tolist())

    def warm_up(self) -> None:
        """The first spec graphs were captured: eager work of its own a drafter runs once, before any request
        meets it."""

    def before_spec(self, batch) -> None:
        """Spec chunks for `batch` follow other kinds of step."""

    def before_chunk(self, batch) -> None:
        """A spec chunk for `batch` is about to be queued."""

    def after_chunk(self, batch, row_stats) -> None:
        """A spec chunk for `batch` was read: its counters per row (see _spec_accept_kernel)."""

    def before_decode(self, batch) -> None:
        """A decode chunk for `batch` is about to be queued."""

    def after_eager(self, batch, hidden: torch.Tensor, sampled: torch.Tensor) -> None:
        """An eager step ran `batch` (its final hidden states and samples)."""

    def after_decode(self, hidden, residual, ids, positions, meta) -> None:
        """A captured decode step ran (its last layer's output and residual; ids and positions advanced)."""

    def after_verify(self, hidden, residual, verify, hist, ntok, tables) -> None:
        """A captured verify step accepted its drafts (`verify`: the step's ids, positions, slots, ctx, seeds)."""


class DeviceNgramDrafter(DeviceVerifier):
    """The spec graphs' n-gram drafter: NgramRule's prompt lookup, run inside each captured verify step."""

    method = "ngram"
    rule = NGRAM_RULE

    def draft(self, state, verify, tables: torch.Tensor, block_size: int) -> None:
        """n-gram drafts for every row of `state` (hist, ntok, cap, max_pos, req_seed, n_draft) written as the
        inputs of a K + 1-row verify step (`verify`: ids, positions, slots, ctx, seeds)."""
        hist, ntok, cap, max_pos, req_seed, n_draft = state
        ids, positions, slots, ctx, seeds = verify
        k = self.drafts_per_step(ids, hist)
        _spec_draft_kernel[(hist.shape[0],)](
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
            hist.stride(0),
            tables.stride(0),
            K=k,
            Q_BLOCK=_pow2(k + 1),
            MIN_N=self.rule.min_n,
            MAX_N=self.rule.max_n,
            BLOCK_SIZE=block_size,
            SCAN=1024,
            **self.kernels._pdl,
        )
