"""Paged attention in Triton: q/k-norm + rope + KV-cache write in one pass, and one attention kernel for prefill,
chunked prefill and decode. The decode-only variants are in decode_attention.py."""

import triton
import triton.language as tl

from .primitives import _after_producer, _dot


# What normalizing and rotating a head reads besides the head itself ([1, D] each). None of it is written by the
# step's kernels, so a kernel may read it before its producer wait.
@triton.jit
def _head_norm_weight(w_ptr, D: tl.constexpr, HAS_NORM: tl.constexpr):
    """The per-head norm weight and the same with halves swapped (ones without a norm)."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, D)[None, :]
    if HAS_NORM:
        w = tl.load(w_ptr + d).to(tl.float32)
        w_swapped = tl.load(w_ptr + (d + HALF) % D).to(tl.float32)
    else:
        w = tl.full([1, D], 1.0, tl.float32)
        w_swapped = w
    return w, w_swapped


@triton.jit
def _cos_sin(pos_cs, D: tl.constexpr):
    """cos and sin of one position (pos_cs points at its row of the table)."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, D)[None, :]
    return tl.load(pos_cs + d % HALF), tl.load(pos_cs + HALF + d % HALF)


@triton.jit
def _apply_norm_rope(
    src, w, w_swapped, cos, sin, eps, mask, D: tl.constexpr, HAS_NORM: tl.constexpr, dtype: tl.constexpr
):
    """Heads [rows, D] at src + d (src [rows, 1] pointers), optionally rmsnormed per head, rotated neox-style:
    element d pairs with the one half a head away. w .. sin: _head_norm_weight and _cos_sin."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, D)[None, :]
    x = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(src + (d + HALF) % D, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rms = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        x = (x * rms * w).to(dtype).to(tl.float32)
        xp = (xp * rms * w_swapped).to(dtype).to(tl.float32)
    return tl.where(d < HALF, x * cos - xp * sin, x * cos + xp * sin).to(dtype)


@triton.jit
def _store_new_kv(
    row_ptr,
    kw,
    kw_swapped,
    cos,
    sin,
    eps,
    slot,
    kvh,
    k_cache,
    v_cache,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    HAS_NORM: tl.constexpr,
    dtype: tl.constexpr,
    ok=True,
):
    """Rotated keys and the values of kv heads kvh .. kvh + BLOCK_KV (< KVH) of one qkv row, into cache slot;
    returns them ([BLOCK_KV, D] each, as stored). kw .. sin: the key's _head_norm_weight and _cos_sin. ok False:
    nothing is read or stored."""
    h = kvh + tl.arange(0, BLOCK_KV)[:, None]
    d = tl.arange(0, D)[None, :]
    m = (h < KVH) & ok
    k = _apply_norm_rope(row_ptr + (H + h) * D, kw, kw_swapped, cos, sin, eps, m, D, HAS_NORM, dtype)
    cdt = k_cache.dtype.element_ty
    dst = slot * KVH * D + h * D + d
    k = k.to(cdt)
    v = tl.load(row_ptr + (H + KVH + h) * D + d, mask=m).to(cdt)
    tl.store(k_cache + dst, k, mask=m)
    tl.store(v_cache + dst, v, mask=m)
    return k, v


@triton.jit
def _qkv_rope_store_kernel(
    qkv_ptr,
    q_out_ptr,
    qn_ptr,
    kn_ptr,
    cos_sin_ptr,
    pos_ptr,
    slot_ptr,
    k_cache,
    v_cache,
    stride_qkv,
    eps,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    _after_producer(PDL)
    t = tl.program_id(0)
    dtype = q_out_ptr.dtype.element_ty
    pos_cs = cos_sin_ptr + tl.load(pos_ptr + t).to(tl.int64) * D
    row = qkv_ptr + t * stride_qkv
    h = tl.arange(0, BLOCK_H)[:, None]
    qw, qw_swapped = _head_norm_weight(qn_ptr, D, HAS_NORM)
    cos, sin = _cos_sin(pos_cs, D)
    q = _apply_norm_rope(row + h * D, qw, qw_swapped, cos, sin, eps, h < H, D, HAS_NORM, dtype)
    tl.store(q_out_ptr + t * H * D + h * D + tl.arange(0, D)[None, :], q, mask=h < H)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        kw, kw_swapped = _head_norm_weight(kn_ptr, D, HAS_NORM)
        _store_new_kv(
            row, kw, kw_swapped, cos, sin, eps, slot, 0, k_cache, v_cache, H, KVH, D, BLOCK_KV, HAS_NORM, dtype
        )


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache,
    v_cache,
    slot_ptr,
    stride_k,
    stride_v,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    _after_producer(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        cols = tl.arange(0, BLOCK)
        m = cols < WIDTH
        cdt = k_cache.dtype.element_ty
        tl.store(k_cache + slot * WIDTH + cols, tl.load(k_ptr + t * stride_k + cols, mask=m).to(cdt), mask=m)
        tl.store(v_cache + slot * WIDTH + cols, tl.load(v_ptr + t * stride_v + cols, mask=m).to(cdt), mask=m)


@triton.jit
def _as_dot_operand(q, k_cache):
    """q in the dtype attention's dots run in: an fp8-e5m2 cache widens exactly to fp16, so 16-bit activations
    meet it there (fp32 stays fp32)."""
    if k_cache.dtype.element_ty == tl.float8e5:  # noqa: SIM102 (constexpr tests, kept apart for Triton)
        if q.dtype != tl.float32:
            q = q.to(tl.float16)
    return q


@triton.jit
def _kv_tile(
    k_cache,
    v_cache,
    tables_ptr,
    seq,
    kvh,
    start,
    hi,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    max_blocks,
    dtype: tl.constexpr,
):
    """Cached keys and values of positions start .. start + BLOCK_N (< hi) through the block table: (k, v, n)."""
    d = tl.arange(0, D)
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < hi
    block = tl.load(tables_ptr + seq * max_blocks + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    offs = (block * BLOCK_SIZE + n % BLOCK_SIZE) * KVH * D + kvh * D
    k = tl.load(k_cache + offs[:, None] + d[None, :], mask=n_ok[:, None], other=0.0).to(dtype)
    v = tl.load(v_cache + offs[:, None] + d[None, :], mask=n_ok[:, None], other=0.0).to(dtype)
    return k, v, n


@triton.jit
def _softmax_update(q, k, v, n, lo, hi, q_pos, scale, acc, m_i, l_i):
    """One tile of the online softmax: keys k / values v at positions n; those outside lo .. hi or after q_pos are
    masked (lo, hi: scalars or [BLOCK_M, 1] per query row). A row with no visible key in the tile keeps its state
    bit for bit, so a row may run through tiles that are not its own."""
    s = _dot(q, tl.trans(k)) * scale
    s = tl.where((n[None, :] >= lo) & (n[None, :] < hi) & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
    p, alpha, m_new = _softmax_step(s, m_i)
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return acc, m_new, l_i


@triton.jit
def _softmax_step(s, m_i):
    """The online softmax over one tile of masked scores s [rows, keys]: (p, alpha = the rescale of what the rows
    summed so far, the new running max). Callers add p's row sums after their P.V dot (the order the kernels were
    timed in: summing first moves a barrier into the key loop)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return p, alpha, m_new


@triton.jit
def _attention_tile(
    q,
    k_cache,
    v_cache,
    tables_ptr,
    seq,
    kvh,
    q_pos,
    lo,
    hi,
    row_lo,
    row_hi,
    scale,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    max_blocks,
    acc,
    m_i,
    l_i,
):
    """Online softmax of q [BLOCK_M, D] over cached keys lo..hi (each row sees row_lo .. row_hi of them, see
    _softmax_update), continuing from (acc, running max, running sum); q arrives as _as_dot_operand made it."""
    for start in range(lo, hi, BLOCK_N):
        k, v, n = _kv_tile(
            k_cache, v_cache, tables_ptr, seq, kvh, start, hi, KVH, D, BLOCK_SIZE, BLOCK_N, max_blocks, q.dtype
        )
        acc, m_i, l_i = _softmax_update(q, k, v, n, row_lo, row_hi, q_pos, scale, acc, m_i, l_i)
    return acc, m_i, l_i


@triton.jit
def _softmax_start(BLOCK_M: tl.constexpr, D: tl.constexpr):
    return (
        tl.zeros([BLOCK_M, D], tl.float32),
        tl.full([BLOCK_M], float("-inf"), tl.float32),
        tl.zeros([BLOCK_M], tl.float32),
    )


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache,
    v_cache,
    out_ptr,
    tables_ptr,
    qstart_ptr,
    ctx_ptr,
    scale,
    max_blocks,
    rows_per_table,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (sequence, kv head, query tile); a tile's rows are (query token, head of the kv group) pairs."""
    _after_producer(PDL)
    seq, kvh, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    GROUP: tl.constexpr = H // KVH
    q_first = tl.load(qstart_ptr + seq)
    q_len = tl.load(qstart_ptr + seq + 1) - q_first
    if tile * BLOCK_Q < q_len:
        ctx = tl.load(ctx_ptr + seq)
        r = tl.arange(0, BLOCK_M)
        t = tile * BLOCK_Q + r // GROUP
        head = kvh * GROUP + r % GROUP
        ok = (r < BLOCK_Q * GROUP) & (t < q_len)
        d = tl.arange(0, D)
        q_offs = (q_first + t)[:, None] * (H * D) + head[:, None] * D + d[None, :]
        q = _as_dot_operand(tl.load(q_ptr + q_offs, mask=ok[:, None], other=0.0), k_cache)
        q_pos = ctx - q_len + t
        hi = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_Q)  # causal: later keys are invisible to this tile
        acc, m_i, l_i = _softmax_start(BLOCK_M, D)
        acc, m_i, l_i = _attention_tile(
            q,
            k_cache,
            v_cache,
            tables_ptr,
            seq // rows_per_table,
            kvh,
            q_pos,
            0,
            hi,
            0,
            hi,
            scale,
            KVH,
            D,
            BLOCK_SIZE,
            BLOCK_M,
            BLOCK_N,
            max_blocks,
            acc,
            m_i,
            l_i,
        )
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_offs, out.to(out_ptr.dtype.element_ty), mask=ok[:, None])
