"""The skinny GEMM for decode-sized batches: 16-bit, fp8 and int4 weights, split-K, and an argmax epilogue for a
greedy step's vocabulary projection."""

import triton
import triton.language as tl

from .decode_step import _argmax_key
from .primitives import _INTERPRETED, _after_producer, _dot, _prefetch_l2
from .quant import _int4_tile


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    scales_ptr,
    offsets_ptr,
    out_ptr,
    keys_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    WKIND: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    LINE: tl.constexpr,
    KEY_CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
    X_GROUP: tl.constexpr = 0,
    INT8_X: tl.constexpr = False,
    x_sum_ptr=None,
    W_AS_A: tl.constexpr = False,
):
    """out = x · Wᵀ for decode-sized batches (up to 64 rows): W streamed once through a pipelined K loop.

    FP8 (WKIND 1): x arrives quantized per token (x_scale [M]) and both operands go to the fp8 tensor cores as
    they are; the epilogue applies x_scale ⊗ w_scale. X_GROUP > 0: x has a scale per token and group of X_GROUP
    columns (x_scale [M, ceil(K / X_GROUP)]; X_GROUP and BLOCK_K powers of two), applied to each group's partial
    product.
    INT4 (WKIND 2): with INT8_X, x arrives as Int8Rows (x_scale_ptr, x_sum_ptr: its scales and sums) and meets
    the nibbles on the int8 tensor cores (_int4_int8_step); otherwise each W tile is widened to x's dtype in
    registers (_int4_tile, as the dequantization pass does), so the products are those of the dequantized weight.
    W_AS_A (int4, widened): the widened weight tile is the dot's first operand, which Hopper's wgmma reads from
    registers (x, the second, from shared memory), and 64 weight rows fill wgmma's 64-row side whatever the batch
    (int4_wide_config); otherwise x's rows are the first operand and the widened tile the second.
    SPLIT_K > 1: program (n, m, s) multiplies the s-th slice of K (K divides into SPLIT_K slices of BLOCK_K
    multiples), so a few-MB weight is streamed by SPLIT_K times more programs. Each stores its fp32 partial tile
    in part_ptr and counts itself in count_ptr[tile]; the last to arrive adds the partials in slice order (the
    same bits whichever arrives last), writes out and sets the count back to 0 for the next call.
    KEY_CHUNKS > 0 (a greedy step's vocabulary projection): the outputs, rounded to out_ptr's dtype, are not
    written; each program's row maxima go into keys_ptr's [M, KEY_CHUNKS] argmax_keys keys (zeros on entry), chunk
    pid_n % KEY_CHUNKS, by atomic max: the same keys whatever order the programs run in.
    """
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    ok = m_ok[:, None] & n_ok[None, :]
    k_slice = K // SPLIT_K
    if PREFETCH_LINES > 0:  # this program's fp8 weight slice (LINE elements a 128-byte line) while x's producer runs
        cols = split * k_slice + tl.minimum(tl.arange(0, PREFETCH_LINES) * LINE, k_slice - 1)
        _prefetch_l2(w_ptr + tl.minimum(rn, N - 1)[:, None] * K + cols[None, :])
    _after_producer(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M] if W_AS_A else [BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(split * k_slice, (split + 1) * k_slice, BLOCK_K):
        if X_GROUP > 0:
            SUB: tl.constexpr = min(BLOCK_K, X_GROUP)
            for g in tl.static_range(BLOCK_K // SUB):
                rk = k0 + g * SUB + tl.arange(0, SUB)
                x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_ok[:, None], other=0.0)
                w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=n_ok[:, None], other=0.0)
                x_scale = tl.load(
                    x_scale_ptr + rm * tl.cdiv(K, X_GROUP) + (k0 + g * SUB) // X_GROUP, mask=m_ok, other=0.0
                )
                acc += _dot(x, tl.trans(w)) * x_scale[:, None]
        elif INT8_X:
            acc = _int4_int8_step(
                x_ptr,
                x_scale_ptr,
                x_sum_ptr,
                w_ptr,
                scales_ptr,
                offsets_ptr,
                rm,
                m_ok,
                rn,
                n_ok,
                K,
                k0,
                acc,
                GROUP,
                BLOCK_K,
            )
        else:
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_ok[:, None], other=0.0)
            if WKIND == 2:
                w = _int4_tile(w_ptr, scales_ptr, offsets_ptr, rn, n_ok, K, k0, GROUP, BLOCK_N, BLOCK_K, True).to(
                    x.dtype
                )
            else:
                w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=n_ok[:, None], other=0.0)
            if W_AS_A:
                acc = _dot(w, tl.trans(x), acc)
            else:
                acc += _dot(x, tl.trans(w))
    if W_AS_A:
        acc = tl.trans(acc)
    tile_offs = rm[:, None] * N + rn[None, :]
    last = True
    if SPLIT_K > 1:
        tl.store(part_ptr + split * M * N + tile_offs, acc, mask=ok)
        tl.debug_barrier()  # every thread's partial is written before the count says so
        tile = pid_m * tl.num_programs(0) + pid_n
        last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
        if last:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):  # past L1: other SMs wrote these
                acc += tl.load(part_ptr + s * M * N + tile_offs, mask=ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0)
    if last:
        if WKIND == 1:
            if X_GROUP == 0:
                acc = acc * tl.load(x_scale_ptr + rm, mask=m_ok, other=0.0)[:, None]
            acc = acc * tl.load(scales_ptr + rn, mask=n_ok, other=0.0)[None, :]
        if KEY_CHUNKS > 0:
            value = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            keys = tl.max(tl.where(ok, _argmax_key(value, rn[None, :]), 0), axis=1)
            tl.atomic_max(keys_ptr + rm * KEY_CHUNKS + pid_n % KEY_CHUNKS, keys, mask=m_ok)
        else:
            tl.store(out_ptr + tile_offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _int8_dot(a, b, acc=None):
    """a @ b of int8 operands summed exactly in int32 (the interpreter: in float32, exact at these sizes)."""
    if _INTERPRETED:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32)).to(tl.int32)
        if acc is not None:
            out += acc
    else:
        out = tl.dot(a, b, acc, out_dtype=tl.int32)
    return out


@triton.jit
def _int4_int8_step(
    x_ptr,
    x_scale_ptr,
    x_sum_ptr,
    w_ptr,
    scales_ptr,
    offsets_ptr,
    rm,
    m_ok,
    rn,
    n_ok,
    K,
    k0,
    acc,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc + x · Wᵀ over columns k0 .. k0 + BLOCK_K for int4 rows and x as Int8Rows of the weight's group: the
    nibbles meet x on the int8 tensor cores as they are, low nibbles with each group's even columns, high ones
    with its odd columns (stored in that order), so nothing is widened; a group's exact integer dot d then adds
    x_scale (s d + o x_sum)."""
    HALF: tl.constexpr = GROUP // 2
    for g in tl.static_range(BLOCK_K // GROUP):
        first = k0 + g * GROUP
        x_even = tl.load(x_ptr + rm[:, None] * K + (first + tl.arange(0, HALF))[None, :], mask=m_ok[:, None], other=0)
        x_odd = tl.load(
            x_ptr + rm[:, None] * K + (first + HALF + tl.arange(0, HALF))[None, :], mask=m_ok[:, None], other=0
        )
        x_at = rm * (K // GROUP) + first // GROUP
        x_scale = tl.load(x_scale_ptr + x_at, mask=m_ok, other=0.0)
        x_sum = tl.load(x_sum_ptr + x_at, mask=m_ok, other=0.0)
        p = tl.load(
            w_ptr + rn[:, None] * (K // 2) + (first // 2 + tl.arange(0, HALF))[None, :], mask=n_ok[:, None], other=0
        )
        d = _int8_dot(x_odd, tl.trans((p >> 4).to(tl.int8)), _int8_dot(x_even, tl.trans((p & 0xF).to(tl.int8))))
        w_at = rn * (K // GROUP) + first // GROUP
        s = tl.load(scales_ptr + w_at, mask=n_ok, other=0.0)
        o = tl.load(offsets_ptr + w_at, mask=n_ok, other=0.0)
        acc += x_scale[:, None] * (d.to(tl.float32) * s[None, :] + x_sum[:, None] * o[None, :])
    return acc
