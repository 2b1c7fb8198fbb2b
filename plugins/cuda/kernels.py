"""Triton kernels for the CUDA backend; each matches ReferenceKernels (tests run them under TRITON_INTERPRET=1).

Activations are bf16/fp16 rows; every kernel rounds where the reference rounds, so the two agree to bf16 noise.
Besides the Kernels interface this adds the fused ops the CUDA forward (forward.py) uses: q/k-norm + rope + KV
write in one pass, rmsnorm fused into a small-batch GEMV prologue, and SiLU-and-mul fused into its epilogue.
"""

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flashnext.core.kernels import AttentionMetadata, ReferenceKernels
from flashnext.core.precision import FP8_MAX, Fp8Weight, Int4Weight, Weight

try:  # grid dependency control (programmatic dependent launch), Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: kernels launch plainly
    gdc_launch_dependents = gdc_wait = None

# Rows up to this many go through the fused norm-GEMV (one weight read per program, rows unrolled): small decode
# batches. Beyond ~4 rows a tiled GEMM (the skinny GEMM below, or cuBLAS) is faster on a Qwen3-0.6B shape
# (docs/benchmarks.md).
GEMV_MAX_ROWS = 4
# Input sizes whose whole row fits one program's registers beside other rows of x (the GEMV keeps all of x and
# its W tile live).
GEMV_MAX_K = 4096
# Longer int4 rows (the down projections of 1.7B-8B models) still take the GEMV, up to this long: in two pieces, a
# row per program (gemv_config, gemv_k_pieces, gemv_row_block). H200, us a call against the skinny GEMM at 1 / 2 / 4
# rows: Qwen3-8B's 4,096 x 12,288 13.5 / 23.8 / 44.1 vs 51.9 / 44.8 / 44.8; 4B's 2,560 x 9,728 6.6 / 12.5 / 19.9 vs
# 27.5 / 35.7 / 35.8; 1.7B's 2,048 x 6,144 3.8 / 5.7 / 9.8 vs 13.8 / 14.7 / 14.7; Llama-3-8B's 4,096 x 14,336 18.5 /
# 35.0 / 66.7 vs 59.3 / 51.3 / 51.3. 16-bit and fp8 rows that long take it for calls of up to
# CudaKernels.long_gemv_rows rows (LONG_GEMV_MAX_ROWS; 0 in graphs whose verify rows must take their decode row's
# route, where the skinny GEMM reads the weight once for all of them): two rows through the GEMV lose to the skinny
# GEMM, one row gains (gemv_config; captured batch-1 steps, H200: Qwen3-4B bf16 3,740 -> 2,721 us, fp8 2,493 ->
# 1,963; 8B bf16 4,160 -> 4,099, fp8 3,009 -> 2,638; 1.7B bf16 1,381 -> 1,204, fp8 1,089 -> 936).
LONG_GEMV_MAX_K, LONG_GEMV_MAX_ROWS = 16384, 1
# Weights of at least this many elements (the layers of 1.7B and larger models; Qwen3-0.6B's are under 6.3M) run
# the GEMV a row a program, and only for calls of up to CudaKernels.large_gemv_rows rows (LARGE_GEMV_MAX_ROWS
# outside row-invariant graphs); more rows go to the skinny GEMM (int4 ones meeting Int8Rows: _meets_int8_rows).
# Captured decode steps on an H200 at 1 / 2 / 4 rows, rows sharing the GEMV's programs before: Qwen3-4B bf16
# 3,739 / 6,849 / 9,167 us, through the skinny GEMM above one row 3,734 / 3,086 / 3,149; fp8 2,504 / 4,410 /
# 6,949 -> 2,498 / 2,794 / 2,873; 8B bf16 4,165 / 8,582 / 11,486 -> 4,161 / 5,440 / 5,564; 1.7B bf16 1,388 /
# 1,785 / 2,425 -> 1,391 / 1,446 / 1,546. Int4, the GEMV a row a program (the skinny GEMM widening its nibbles was
# slower) against the skinny GEMM with Int8Rows: 4B 3,469 / 4,951 -> 2,799 / 2,885, 8B 4,360 / 6,207 -> 3,838 /
# 4,046, 1.7B 1,561 / 1,999 -> 1,401 / 1,510.
LARGE_WEIGHT, LARGE_GEMV_MAX_ROWS = 1 << 23, 1
# Wider 16-bit outputs (a vocabulary projection) stay on cuBLAS, which streams them at full bandwidth already;
# quantized ones only our kernels read.
GEMV_MAX_N = 32768
# Keys a split-KV decode program reads per tile.
SPLIT_BLOCK_N = 32
# A greedy step's argmax: up to this many programs a row, each over at least ARGMAX_MIN_CHUNK logits (Qwen3's
# 151,936: 128 x 1,187).
ARGMAX_CHUNKS, ARGMAX_MIN_CHUNK = 128, 1024
# fp8 weights at batches up to this many rows (decode) use the skinny Triton GEMM; larger ones torch._scaled_mm.
SKINNY_MAX_ROWS = 64
# Int4 batches up to this many rows widen their nibbles inside the skinny GEMM (int4_skinny_config); larger ones
# dequantize in a pass first (H200, Qwen3 shape, captured int4 decode steps against the pass: 5 rows 17% shorter,
# 8: 14%, 16: 16%, 32: 5%; at 64 rows the seven fused configurations tried were 4-15% longer). So do large int4
# weights meeting Int8Rows (_meets_int8_rows; Qwen3-8B, captured steps against widening: 32 rows 16,264 -> 6,799
# us; at 64 rows against the pass 11,239 -> 11,361, so the pass stays).
INT4_SKINNY_MAX_ROWS = 32
# Large int4 weights (LARGE_WEIGHT) of at least INT4_WIDE_MIN_N outputs at 17-64 rows are widened as the skinny
# GEMM's first operand instead (_wide_int4, int4_wide_config), but for the widest (gate/up, outputs >= 4 x K) up to
# 32 rows, where Int8Rows stay ahead on 4B. One call on an H200 against the route before (Int8Rows up to 32 rows,
# the pass above), us: 8B down 53.6 -> 36.3 at 32 rows, 76.2 -> 43.0 at 64; 4B gate/up 72.5 -> 44.4 at 64. Fewer
# outputs make too few programs of 64 weight rows: with 1.7B's down projection (2,048) wide, its int4 engine
# decoded 5-7% slower at 24 and 32 rows (docs/benchmarks.md).
INT4_WIDE_ROWS, INT4_WIDE_MIN_N = (17, 64), 2560
# Up to this many rows the wide route's GEMM starts when its producer has finished, not under programmatic dependent
# launch: engine int4 decode at 24 and 32 rows 12-13% faster on Qwen3-4B and 8B, 2-3% on 1.7B; at 64 rows PDL stays
# (4B 3% slower without). Only this route gains: every skinny GEMM so launched made bf16 and fp8 decode 2-12% slower
# (H200, docs/benchmarks.md).
INT4_WIDE_SERIAL_ROWS = 32
# Decode steps of more rows than this over an fp8-e5m2 cache hand the fp8 o projection its input quantized by the
# attention kernel, a scale per token and kv group (heads_per_scale), no pass between (H200, Qwen3 shape, captured
# fp8 + e5m2 steps with a scale a head: 64 rows 1,276.9 -> 1,253.8 us; 16 rows unchanged; 32 rows 1,225.8 ->
# 1,285.5, where the attention is one wave of programs and the GEMM, started beside it by programmatic dependent
# launch, slows the pair by about 12 us a layer).
HEAD_SCALES_ABOVE_ROWS = 32


# A GEMV hands its output to the int4 GEMV after it as a PackedX (see PACKED_BLOCK) only for rows of at least this
# many columns: each consumer program's rounding grows with its row, the producer's epilogue does not. H200,
# captured int4 batch-1 steps, every hand-over against none: Qwen3-0.6B 526 -> 532 us, 1.7B 807 -> 827, 4B 1,393 ->
# 1,412, 8B 2,128 -> 2,056; only to the down projections (rows of 6,144-12,288): 1.7B 806, 4B 1,383, 8B 2,085.
PACKED_X_MIN_K = 4096


# Triton's CPU interpreter (the CI tests): it mis-multiplies bf16 dots (3.9), so dots run in fp32 under it, and it
# runs no inline assembly, so dp4a is spelled out there.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def pdl_supported() -> bool:
    """Programmatic dependent launch: Hopper or newer, a Triton that has it, not the CPU interpreter."""
    if gdc_wait is None or os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= (9, 0)


@triton.jit
def _after_producer(PDL: tl.constexpr):
    """Under programmatic dependent launch a kernel starts while the previous one still runs: wait here until its
    writes are visible, then let the next kernel's programs start too. Nothing may be written or read from an
    earlier kernel's output before this point; constant data (weights) may be, and should be: that is the gain."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ptrs. Nothing waits on a prefetch, so a kernel can issue its reads of data
    that no running kernel writes before its programmatic-dependent-launch wait, and find them in L2 after it."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _dot(a, b, acc=None):
    if _INTERPRETED:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif a.dtype == tl.float32:
        # fp32 means fp32: tl.dot would otherwise round fp32 inputs to TF32 (NMSE ~1e-7 in conformance)
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Norms


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    w_ptr,
    out_ptr,
    K,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    fp8_ptr=None,
    scale_ptr=None,
    FMAX: tl.constexpr = 0.0,
    sum_ptr=None,
    INT8_GROUP: tl.constexpr = 0,
):
    """rmsnorm(x (+ res)); with FMAX the normalized row goes out as per-token fp8 (fp8_ptr, scale_ptr) instead,
    bit-equal to normalizing and then quantizing in two passes; with INT8_GROUP as Int8Rows (fp8_ptr, scale_ptr,
    sum_ptr)."""
    _after_producer(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    x = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0)
    if HAS_RES:
        # The reference adds in the activation dtype, then normalizes the rounded sum.
        x = x.to(tl.float32) + tl.load(res_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * K + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (xf * rms * w).to(out_ptr.dtype.element_ty)
    if FMAX > 0:
        _quantize_row(normed.to(tl.float32), fp8_ptr + row * K + cols, mask, scale_ptr + row, FMAX)
    elif INT8_GROUP > 0:
        groups = K // INT8_GROUP
        _store_int8_groups(
            normed.to(tl.float32),
            0,
            K,
            fp8_ptr + row * K,
            scale_ptr + row * groups,
            sum_ptr + row * groups,
            BLOCK_K,
            INT8_GROUP,
        )
    else:
        tl.store(out_ptr + row * K + cols, normed, mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# q/k norm + rope + KV-cache write


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


# ---------------------------------------------------------------------------------------------------------------
# Paged attention: one kernel for prefill, chunked prefill and decode; a split-KV variant for small decode batches


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


@triton.jit
def _e5m2_pairs_to_fp16(pairs):
    """An fp8-e5m2 tile read as int16 pairs -> its even and odd elements as fp16, exactly: an e5m2 byte is the
    high byte of the fp16 it equals, so each is one byte permute or one and for two pairs a 32-bit register."""
    if _INTERPRETED:
        even = (pairs << 8).to(tl.float16, bitcast=True)
        odd = (pairs & -256).to(tl.float16, bitcast=True)
    else:
        even = tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, 0, 0x2404;", "=r,r", [pairs], dtype=tl.float16, is_pure=True, pack=2
        )
        odd = tl.inline_asm_elementwise(
            "and.b32 $0, $1, 0xFF00FF00;", "=r,r", [pairs], dtype=tl.float16, is_pure=True, pack=2
        )
    return even, odd


@triton.jit
def _decode_e5m2_kernel(
    q_ptr,
    k_cache,
    v_cache,
    k_pairs,
    v_pairs,
    out_ptr,
    tables_ptr,
    qstart_ptr,
    ctx_ptr,
    scale,
    max_blocks,
    rows_per_table,
    stride_q,
    qn_ptr,
    kn_ptr,
    cos_sin_ptr,
    pos_ptr,
    slot_ptr,
    eps,
    out_scale_ptr,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROPE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FMAX: tl.constexpr,
    PDL: tl.constexpr,
    SCALE_HEADS: tl.constexpr = 1,
):
    """Decode attention (one query row a sequence; program (sequence, kv head)) over an fp8-e5m2 cache read as
    int16 pairs (k_pairs / v_pairs: the caches viewed so): q.k = q_even.k_even + q_odd.k_odd, and the even and
    odd output columns come from two P.V dots. The tiles then reach the tensor cores as 16-bit operands straight
    from shared memory, where widening the bytes in the operand layout costs Triton byte loads and converts
    (H200, batch 64, contexts 256-382: 23.8 -> 16.0 us a layer; the bf16 cache's kernel 26.8).

    ROPE (a table row a sequence): q_ptr is the merged qkv rows, and the kernel first does what
    _qkv_rope_store_kernel would (q/k norm, rotation, this kv head's new key and value into the cache: a launch
    less a layer); the barrier after it makes those stores visible to the key loop.

    FMAX > 0 (the o projection takes fp8 rows): the output, rounded to the activations' dtype, goes out as
    fp8-e4m3 with a dynamic scale for each head (out_scale_ptr [rows, H]), or with SCALE_HEADS = H / KVH one for
    the program's heads ([rows, KVH]): the quantization pass before that projection would need the whole token's
    row, which spans KVH programs."""
    seq, kvh = tl.program_id(0), tl.program_id(1)
    GROUP: tl.constexpr = H // KVH
    HALF: tl.constexpr = D // 2
    r = tl.arange(0, BLOCK_M)
    ok = r < GROUP
    head = kvh * GROUP + r
    if ROPE:  # read before the wait: none of it comes from qkv's producer
        qw, qw_swapped = _head_norm_weight(qn_ptr, D, HAS_NORM)
        kw, kw_swapped = _head_norm_weight(kn_ptr, D, HAS_NORM)
        slot = tl.load(slot_ptr + seq)
        cos, sin = _cos_sin(cos_sin_ptr + tl.load(pos_ptr + seq).to(tl.int64) * D, D)
    _after_producer(PDL)
    q_first = tl.load(qstart_ptr + seq)
    if tl.load(qstart_ptr + seq + 1) > q_first:
        ctx = tl.load(ctx_ptr + seq)
        j = tl.arange(0, HALF)
        if ROPE:
            row_ptr = q_ptr + q_first * stride_q
            q = _apply_norm_rope(
                row_ptr + head[:, None] * D,
                qw,
                qw_swapped,
                cos,
                sin,
                eps,
                ok[:, None],
                D,
                HAS_NORM,
                q_ptr.dtype.element_ty,
            )
            q_even, q_odd = tl.split(tl.reshape(q, [BLOCK_M, HALF, 2]))
            if slot >= 0:
                _store_new_kv(
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
                    H,
                    KVH,
                    D,
                    1,
                    HAS_NORM,
                    q_ptr.dtype.element_ty,
                )
            tl.debug_barrier()
        else:
            q_offs = q_first * (H * D) + head[:, None] * D + 2 * j[None, :]
            q_even = tl.load(q_ptr + q_offs, mask=ok[:, None], other=0.0)
            q_odd = tl.load(q_ptr + q_offs + 1, mask=ok[:, None], other=0.0)
        q_even, q_odd = q_even.to(tl.float16), q_odd.to(tl.float16)
        acc_even, m_i, l_i = _softmax_start(BLOCK_M, HALF)
        acc_odd = tl.zeros([BLOCK_M, HALF], tl.float32)
        table = seq // rows_per_table
        for start in range(0, ctx, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < ctx
            block = tl.load(tables_ptr + table * max_blocks + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            offs = ((block * BLOCK_SIZE + n % BLOCK_SIZE) * (KVH * HALF) + kvh * HALF)[:, None] + j[None, :]
            k_even, k_odd = _e5m2_pairs_to_fp16(tl.load(k_pairs + offs, mask=n_ok[:, None], other=0))
            s = _dot(q_odd, tl.trans(k_odd), _dot(q_even, tl.trans(k_even)))
            p, alpha, m_new = _softmax_step(tl.where(n_ok[None, :], s * scale, float("-inf")), m_i)
            v_even, v_odd = _e5m2_pairs_to_fp16(tl.load(v_pairs + offs, mask=n_ok[:, None], other=0))
            p16 = p.to(tl.float16)
            acc_even = _dot(p16, v_even, acc_even * alpha[:, None])
            acc_odd = _dot(p16, v_odd, acc_odd * alpha[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        inv = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
        out_offs = q_first * (H * D) + head[:, None] * D + 2 * j[None, :]
        dtype = q_ptr.dtype.element_ty
        out_even, out_odd = (acc_even * inv[:, None]).to(dtype), (acc_odd * inv[:, None]).to(dtype)
        if FMAX > 0:
            out_even, out_odd = out_even.to(tl.float32), out_odd.to(tl.float32)
            amax = tl.maximum(_finite_amax(out_even, 1), _finite_amax(out_odd, 1))
            if SCALE_HEADS > 1:  # the program's heads share one scale
                o_scale = _fp8_scale(tl.max(tl.where(ok, amax, 0.0), axis=0), FMAX)
                out_even, out_odd = _fp8_values(out_even, o_scale, FMAX), _fp8_values(out_odd, o_scale, FMAX)
                tl.store(out_scale_ptr + q_first * KVH + kvh, o_scale)
            else:
                o_scale = _fp8_scale(amax, FMAX)
                out_even = _fp8_values(out_even, o_scale[:, None], FMAX)
                out_odd = _fp8_values(out_odd, o_scale[:, None], FMAX)
                tl.store(out_scale_ptr + q_first * H + head, o_scale, mask=ok)
        tl.store(out_ptr + out_offs, out_even.to(out_ptr.dtype.element_ty), mask=ok[:, None])
        tl.store(out_ptr + out_offs + 1, out_odd.to(out_ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _new_kv_into_tile(
    row_ptr,
    pos,
    slot,
    cos,
    sin,
    lo,
    hi,
    n0,
    k0,
    v0,
    kw,
    kw_swapped,
    eps,
    kvh,
    k_cache,
    v_cache,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    dtype: tl.constexpr,
):
    """A qkv row's new key and value, if its position falls in lo .. hi: into the cache and into the first key
    tile (k0, v0 at positions n0, already read), which are returned."""
    if (pos >= lo) & (pos < hi) & (slot >= 0):
        new_k, new_v = _store_new_kv(
            row_ptr, kw, kw_swapped, cos, sin, eps, slot, kvh, k_cache, v_cache, H, KVH, D, 1, HAS_NORM, dtype
        )
        k0 = tl.where((n0 == pos)[:, None], new_k.to(k0.dtype), k0)
        v0 = tl.where((n0 == pos)[:, None], new_v.to(v0.dtype), v0)
    return k0, v0


@triton.jit
def _new_kvs_into_tile(
    qkv_ptr,
    stride,
    first,
    last,
    pos_ptr,
    slot_ptr,
    pos,
    slot,
    cos_sin_ptr,
    lo,
    hi,
    n0,
    k0,
    v0,
    kw,
    kw_swapped,
    eps,
    kvh,
    k_cache,
    v_cache,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    NEW_ROWS: tl.constexpr,
    dtype: tl.constexpr,
):
    """_new_kv_into_tile for the qkv rows first .. last (<= first + NEW_ROWS; pos and slot: theirs, -1 past last).
    Each row is roped as one [1, D] tile, as a decode row's own key is (the same bits, q/k norm included); the
    tile positions they land on then read back what was stored (the barrier makes this program's stores visible
    to all its threads). Without q/k norm the rows are unrolled, masked, so that their loads and stores overlap
    rather than chain row after row; with it a row that puts no key in is skipped instead, as its norm's
    reduction costs more than the overlap gains (H200, Qwen3 shape, a verify step with no drafts: +45 us)."""
    if HAS_NORM:
        for j in range(first, last):
            pos_j = tl.load(pos_ptr + j)
            slot_j = tl.load(slot_ptr + j)
            if (slot_j >= 0) & (pos_j >= lo) & (pos_j < hi):
                cos, sin = _cos_sin(cos_sin_ptr + pos_j.to(tl.int64) * D, D)
                _store_new_kv(
                    qkv_ptr + j * stride,
                    kw,
                    kw_swapped,
                    cos,
                    sin,
                    eps,
                    slot_j,
                    kvh,
                    k_cache,
                    v_cache,
                    H,
                    KVH,
                    D,
                    1,
                    HAS_NORM,
                    dtype,
                )
    else:
        for r in tl.static_range(NEW_ROWS):
            j = first + r + tl.zeros([1], tl.int32)  # [1]: the interpreter takes tensor masks only
            pos_j = tl.load(pos_ptr + j, mask=j < last, other=-1)
            slot_j = tl.load(slot_ptr + j, mask=j < last, other=-1)
            cos, sin = _cos_sin(cos_sin_ptr + tl.maximum(pos_j, 0).to(tl.int64) * D, D)
            _store_new_kv(
                qkv_ptr + j * stride,
                kw,
                kw_swapped,
                cos,
                sin,
                eps,
                slot_j,
                kvh,
                k_cache,
                v_cache,
                H,
                KVH,
                D,
                1,
                HAS_NORM,
                dtype,
                ok=(slot_j >= 0) & (pos_j >= lo) & (pos_j < hi),
            )
    new = (slot >= 0) & (pos >= lo) & (pos < hi)
    # The slot each tile position's new key went to (positions of one sequence's rows differ), else -1.
    landed = tl.max(tl.where((n0[:, None] == pos[None, :]) & new[None, :], slot[None, :], -1), axis=1)[:, None]
    tl.debug_barrier()
    src = landed * KVH * D + kvh * D + tl.arange(0, D)[None, :]
    k0 = tl.where(landed >= 0, tl.load(k_cache + src, mask=landed >= 0, other=0.0).to(k0.dtype), k0)
    v0 = tl.where(landed >= 0, tl.load(v_cache + src, mask=landed >= 0, other=0.0).to(v0.dtype), v0)
    return k0, v0


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache,
    v_cache,
    part_ptr,
    ml_ptr,
    tables_ptr,
    ctx_ptr,
    scale,
    max_blocks,
    rows_per_table,
    stride_q,
    qn_ptr,
    kn_ptr,
    cos_sin_ptr,
    pos_ptr,
    slot_ptr,
    eps,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    NEW_ROWS: tl.constexpr,
    ROPE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """Decode only (one query row each; a block-table row serves rows_per_table consecutive rows): split s of
    SPLITS covers one slice of each row's context. The slices depend on the context length alone, so a row's
    result does not depend on how many other rows the step has.

    A program takes BLOCK_Q consecutive rows of one table row (the rows of a speculative verify step: BLOCK_Q
    = BLOCK_M // group, so that its query tile has decode's shape) and reads each key tile once for all of
    them. Slices start at multiples of BLOCK_N, so every row meets its own tiles as a one-row program would,
    and the tiles outside its slice change nothing (_softmax_update): each row's bits equal a decode row's.

    ROPE: q_ptr is the merged qkv rows, and the kernel does what _qkv_rope_store_kernel would have done first
    (a launch less a layer): q/k norm and rotation, and the new keys and values in its slices into the cache,
    those of the table row's earlier rows included (programs writing one slot write the same bits; NEW_ROWS:
    rows_per_table as a power of two). Its first key tile is read before the wait for the producer of qkv (the
    contexts and tables precede layer 0, the cached keys earlier steps), and the new keys that fall in it are put
    in by hand."""
    tile, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tiles_a_table = tl.cdiv(rows_per_table, BLOCK_Q)
    table_row = tile // tiles_a_table
    group_first = table_row * rows_per_table
    first = group_first + (tile % tiles_a_table) * BLOCK_Q
    last = tl.minimum(first + BLOCK_Q, group_first + rows_per_table)  # one past this program's last row
    if BLOCK_Q == 1 or HAS_NORM:  # with q/k norm the verify rows' new keys go a row at a time, skipping dead rows
        _split_program(
            q_ptr,
            k_cache,
            v_cache,
            part_ptr,
            ml_ptr,
            tables_ptr,
            ctx_ptr,
            scale,
            max_blocks,
            stride_q,
            qn_ptr,
            kn_ptr,
            cos_sin_ptr,
            pos_ptr,
            slot_ptr,
            eps,
            table_row,
            group_first,
            first,
            last,
            kvh,
            split,
            H,
            KVH,
            D,
            BLOCK_SIZE,
            BLOCK_M,
            BLOCK_N,
            SPLITS,
            BLOCK_Q,
            NEW_ROWS,
            ROPE,
            HAS_NORM,
            PDL,
            ONE_ROW=BLOCK_Q == 1,
        )
    else:
        # A verify step's rows past its drafts have context 0. When the table row's own token is this program's
        # only live row (a step without drafts), it runs as a decode row (its bits are a decode row's either way),
        # without the verify rows' loads and new-key loop; so does a program with no live row (its rows' keys are
        # the earlier programs' to write). H200, captured K = 4 verify step without drafts: SmolLM2 461 -> 409 us;
        # with q/k norm (Qwen3) 1,346 -> 1,339 for +24 with drafts, so not there.
        rows = first + tl.arange(0, NEW_ROWS)
        ctx = tl.load(ctx_ptr + rows, mask=rows < last, other=0)
        later_dead = tl.max(tl.where(rows > first, ctx, 0), axis=0) == 0
        first_dead = tl.max(tl.where(rows == first, ctx, 0), axis=0) == 0
        if later_dead & ((first == group_first) | first_dead):
            _split_program(
                q_ptr,
                k_cache,
                v_cache,
                part_ptr,
                ml_ptr,
                tables_ptr,
                ctx_ptr,
                scale,
                max_blocks,
                stride_q,
                qn_ptr,
                kn_ptr,
                cos_sin_ptr,
                pos_ptr,
                slot_ptr,
                eps,
                table_row,
                group_first,
                first,
                last,
                kvh,
                split,
                H,
                KVH,
                D,
                BLOCK_SIZE,
                BLOCK_M,
                BLOCK_N,
                SPLITS,
                BLOCK_Q,
                NEW_ROWS,
                ROPE,
                HAS_NORM,
                PDL,
                ONE_ROW=True,
            )
        else:
            _split_program(
                q_ptr,
                k_cache,
                v_cache,
                part_ptr,
                ml_ptr,
                tables_ptr,
                ctx_ptr,
                scale,
                max_blocks,
                stride_q,
                qn_ptr,
                kn_ptr,
                cos_sin_ptr,
                pos_ptr,
                slot_ptr,
                eps,
                table_row,
                group_first,
                first,
                last,
                kvh,
                split,
                H,
                KVH,
                D,
                BLOCK_SIZE,
                BLOCK_M,
                BLOCK_N,
                SPLITS,
                BLOCK_Q,
                NEW_ROWS,
                ROPE,
                HAS_NORM,
                PDL,
                ONE_ROW=False,
            )


@triton.jit
def _split_program(
    q_ptr,
    k_cache,
    v_cache,
    part_ptr,
    ml_ptr,
    tables_ptr,
    ctx_ptr,
    scale,
    max_blocks,
    stride_q,
    qn_ptr,
    kn_ptr,
    cos_sin_ptr,
    pos_ptr,
    slot_ptr,
    eps,
    table_row,
    group_first,
    first,
    last,
    kvh,
    split,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    NEW_ROWS: tl.constexpr,
    ROPE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
    ONE_ROW: tl.constexpr,
):
    """_decode_split_kernel's work for rows first .. last - 1; ONE_ROW: row `first` alone attends (as decode), the
    others' results are stored empty (no keys: the reduce gives them zeros)."""
    GROUP: tl.constexpr = H // KVH
    r = tl.arange(0, BLOCK_M)
    row = first + r // GROUP
    head = kvh * GROUP + r % GROUP
    ok = (r < BLOCK_Q * GROUP) & (row < last)  # the rows this program stores
    if ONE_ROW and BLOCK_Q > 1:
        ok_q = ok & (r < GROUP)  # the rows that attend
    else:
        ok_q = ok
    ctx = tl.load(ctx_ptr + row, mask=ok_q, other=0)
    chunk = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N
    row_lo = split * chunk
    row_hi = tl.minimum(ctx, row_lo + chunk)
    live = ok_q & (row_lo < row_hi)
    hi = tl.max(tl.where(live, row_hi, 0), axis=0)
    lo = tl.minimum(tl.min(tl.where(live, row_lo, 1 << 30), axis=0), hi)  # the rows' slices together
    row_lo, row_hi = row_lo[:, None], row_hi[:, None]
    dtype = q_ptr.dtype.element_ty
    if ROPE:
        # Read before the wait, as none of it comes from qkv's producer: the first key tile, the rows' positions
        # (written before layer 0), the norm weights and the positions' cos / sin; a decode row's slot too (verify
        # rows read theirs in the new-key loop below, where each row's position and cos / sin come from cache).
        k0, v0, n0 = _kv_tile(
            k_cache, v_cache, tables_ptr, table_row, kvh, lo, hi, KVH, D, BLOCK_SIZE, BLOCK_N, max_blocks, dtype
        )
        qw, qw_swapped = _head_norm_weight(qn_ptr, D, HAS_NORM)
        kw, kw_swapped = _head_norm_weight(kn_ptr, D, HAS_NORM)
        if ONE_ROW:  # a decode row: its key's position, slot and cos / sin too
            own_pos = tl.load(pos_ptr + first)
            own_slot = tl.load(slot_ptr + first)
            cos, sin = _cos_sin(cos_sin_ptr + own_pos.to(tl.int64) * D, D)
        else:
            pos = tl.load(pos_ptr + row, mask=ok_q, other=0)
            cos, sin = _cos_sin(cos_sin_ptr + pos.to(tl.int64)[:, None] * D, D)
            # The new keys of the table row's rows up to this program's last: only a program whose slices hold
            # one of them puts any in (a step's rows past its drafts have none).
            new_row = group_first + tl.arange(0, NEW_ROWS)
            new_pos = tl.load(pos_ptr + new_row, mask=new_row < last, other=-1)
            new_slot = tl.load(slot_ptr + new_row, mask=new_row < last, other=-1)
            puts_keys = tl.max(((new_slot >= 0) & (new_pos >= lo) & (new_pos < hi)).to(tl.int32), axis=0) > 0
    _after_producer(PDL)
    d = tl.arange(0, D)
    q_pos = ctx - 1
    acc, m_i, l_i = _softmax_start(BLOCK_M, D)
    if ROPE:
        q = _as_dot_operand(
            _apply_norm_rope(
                q_ptr + row[:, None] * stride_q + head[:, None] * D,
                qw,
                qw_swapped,
                cos,
                sin,
                eps,
                ok_q[:, None],
                D,
                HAS_NORM,
                dtype,
            ),
            k_cache,
        )
        k0, v0 = k0.to(q.dtype), v0.to(q.dtype)  # exact: an e5m2 tile read as 16-bit, fp16 for the dots
        if ONE_ROW:
            k0, v0 = _new_kv_into_tile(
                q_ptr + first * stride_q,
                own_pos,
                own_slot,
                cos,
                sin,
                lo,
                hi,
                n0,
                k0,
                v0,
                kw,
                kw_swapped,
                eps,
                kvh,
                k_cache,
                v_cache,
                H,
                KVH,
                D,
                HAS_NORM,
                dtype,
            )
        elif puts_keys:  # the new keys of this program's rows and of the earlier ones, all at once
            k0, v0 = _new_kvs_into_tile(
                q_ptr,
                stride_q,
                group_first,
                last,
                pos_ptr,
                slot_ptr,
                new_pos,
                new_slot,
                cos_sin_ptr,
                lo,
                hi,
                n0,
                k0,
                v0,
                kw,
                kw_swapped,
                eps,
                kvh,
                k_cache,
                v_cache,
                H,
                KVH,
                D,
                HAS_NORM,
                NEW_ROWS,
                dtype,
            )
        tl.debug_barrier()  # the new keys past the first tile are in the cache before the loop reads them
        acc, m_i, l_i = _softmax_update(q, k0, v0, n0, row_lo, row_hi, q_pos, scale, acc, m_i, l_i)
        lo += BLOCK_N
    else:
        q = _as_dot_operand(
            tl.load(q_ptr + row[:, None] * stride_q + head[:, None] * D + d[None, :], mask=ok_q[:, None], other=0.0),
            k_cache,
        )
    acc, m_i, l_i = _attention_tile(
        q,
        k_cache,
        v_cache,
        tables_ptr,
        table_row,
        kvh,
        q_pos,
        lo,
        hi,
        row_lo,
        row_hi,
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
    base = (row * H + head) * SPLITS + split
    tl.store(part_ptr + base[:, None] * D + d[None, :], acc, mask=ok[:, None])
    tl.store(ml_ptr + base * 2, m_i, mask=ok)
    tl.store(ml_ptr + base * 2 + 1, l_i, mask=ok)


@triton.jit
def _decode_reduce_kernel(part_ptr, ml_ptr, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    _after_producer(PDL)
    row = tl.program_id(0)  # seq * H + head
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    m = tl.load(ml_ptr + (row * SPLITS + s) * 2)
    l = tl.load(ml_ptr + (row * SPLITS + s) * 2 + 1)  # noqa: E741 (the softmax sum, as in the papers)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max)))
    acc = tl.sum(tl.load(part_ptr + (row * SPLITS + s)[:, None] * D + d[None, :]) * w[:, None], axis=0)
    total = tl.sum(l * w, axis=0)
    tl.store(out_ptr + row * D + d, (acc / tl.where(total == 0.0, 1.0, total)).to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------------------------
# Elementwise


@triton.jit
def _silu_mul_kernel(
    x_ptr,
    out_ptr,
    N,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    scale_ptr=None,
    FMAX: tl.constexpr = 0.0,
    sum_ptr=None,
    INT8_GROUP: tl.constexpr = 0,
):
    """silu(gate) * up; with FMAX out takes each program's BLOCK columns as fp8 and scale_ptr their scale
    ([rows, programs along the row]: one program a row, BLOCK >= N, makes it per token); with INT8_GROUP (which
    divides BLOCK) out, scale_ptr and sum_ptr take Int8Rows."""
    _after_producer(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    gate = tl.load(x_ptr + row * 2 * N + cols, mask=m, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * N + N + cols, mask=m, other=0.0)
    # F.silu rounds to the activation dtype before the product, as the reference does.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    act = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
    if FMAX > 0:
        _quantize_row(
            act.to(tl.float32),
            out_ptr + row * N + cols,
            m,
            scale_ptr + row * tl.num_programs(1) + tl.program_id(1),
            FMAX,
        )
    elif INT8_GROUP > 0:
        groups = N // INT8_GROUP
        _store_int8_groups(
            act.to(tl.float32),
            tl.program_id(1) * BLOCK,
            N,
            out_ptr + row * N,
            scale_ptr + row * groups,
            sum_ptr + row * groups,
            BLOCK,
            INT8_GROUP,
        )
    else:
        tl.store(out_ptr + row * N + cols, act, mask=m)


@triton.jit
def _fp8_quant_rows_kernel(x_ptr, q_ptr, scale_ptr, K, FMAX: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    _after_producer(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    m = cols < K
    x = tl.load(x_ptr + row * K + cols, mask=m, other=0.0).to(tl.float32)
    _quantize_row(x, q_ptr + row * K + cols, m, scale_ptr + row, FMAX)


@triton.jit
def _int8_quant_rows_kernel(
    x_ptr, q_ptr, scale_ptr, sum_ptr, K, GROUP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    _after_producer(PDL)
    row, first = tl.program_id(0), tl.program_id(1) * BLOCK
    cols = first + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * K + cols, mask=cols < K, other=0.0).to(tl.float32)
    _store_int8_groups(
        x, first, K, q_ptr + row * K, scale_ptr + row * (K // GROUP), sum_ptr + row * (K // GROUP), BLOCK, GROUP
    )


@triton.jit
def _quantize_row(x, q_ptrs, m, scale_ptr, FMAX: tl.constexpr):
    """Dynamic per-token activation scale: amax of the row's finite values (x, float32, 0 where not m) lands on
    the format maximum; stores the fp8 row at q_ptrs and its scale."""
    scale = _fp8_scale(_finite_amax(x, 0), FMAX)
    tl.store(q_ptrs, _fp8_values(x, scale, FMAX).to(q_ptrs.dtype.element_ty), mask=m)
    tl.store(scale_ptr, scale)


@triton.jit
def _finite_amax(x, axis: tl.constexpr):
    return tl.max(tl.where(tl.abs(x) < float("inf"), tl.abs(x), 0.0), axis=axis)


@triton.jit
def _fp8_scale(amax, FMAX: tl.constexpr):
    """The scale that puts amax on the format maximum (1 for an all-zero group)."""
    # Floor at the smallest fp32 subnormal (bit pattern 1), written as bits: a literal that small becomes fp64.
    tiny = tl.full([], 1, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(amax > 0, tl.maximum(amax / FMAX, tiny), 1.0)


@triton.jit
def _fp8_values(x, scale, FMAX: tl.constexpr):
    """x / scale clamped to the format's range, in float32 (the caller rounds it to fp8)."""
    q = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
    return tl.where(x == x, q, x)  # min/max drop NaN; a NaN activation must stay NaN through the product


# ---------------------------------------------------------------------------------------------------------------
# GEMV / GEMM


# Weight kinds the GEMV / skinny GEMM read: 16-bit dense, fp8 with one scale per output row, Int4Weight.
DENSE, FP8, INT4 = 0, 1, 2


@triton.jit
def _load_rows(
    w_ptr,
    scales_ptr,
    offsets_ptr,
    n,
    n_ok,
    K,
    k0,
    WKIND: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """BLOCK_N weight rows at n, columns k0 .. k0 + BLOCK_K (those < K), as stored, with their scales and offsets
    (unused ones are 0): (w, s, o). An int4 piece starts and ends on group boundaries."""
    if WKIND == 2:  # int32 words of 8 nibbles (byte j: columns 2j, 2j + 1)
        # Words a row: K // 8 written as a multiple of 4 (int4 rows here hold whole X_BLOCKs of 32 columns), so
        # that Triton sees rows start 16 bytes apart and reads four words a load; from K // 8 it could prove two
        # words at most, one where K is not a multiple of 16 (benchmarks/ptx_census.py).
        words = (K // X_BLOCK) * (X_BLOCK // 8)
        i = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        w = tl.load(
            w_ptr.to(tl.pointer_type(tl.int32)) + n[:, None] * words + i[None, :],
            mask=n_ok[:, None] & (i < words)[None, :],
            other=0,
        )
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        g_mask = n_ok[:, None] & (g < K // GROUP)[None, :]
        s = tl.load(scales_ptr + n[:, None] * (K // GROUP) + g[None, :], mask=g_mask, other=0.0)
        o = tl.load(offsets_ptr + n[:, None] * (K // GROUP) + g[None, :], mask=g_mask, other=0.0)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
        s = tl.load(scales_ptr + n, mask=n_ok, other=0.0) if WKIND == 1 else 0.0
        o = 0.0
    return w, s, o


# Int4 rows meet x quantized to int8 in blocks of this many columns (llama.cpp's q8_1 block), so that the nibbles
# multiply integers four at a time (dp4a) and only each block's sum is scaled.
X_BLOCK = tl.constexpr(32)


@triton.jit
def _dp4a(a, b, c):
    """c + the dot of a's four unsigned bytes with b's four signed ones, in int32 lanes."""
    if _INTERPRETED:
        out = c
        for i in tl.static_range(4):
            out += ((a >> (8 * i)) & 0xFF) * ((b << (24 - 8 * i)) >> 24)
    else:
        out = tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    return out


@triton.jit
def _int8_blocks(xb):
    """xb [blocks, columns] float32 rounded to int8 a block at a time, scaled to the block's largest magnitude:
    (the integers as int32, the block scales, the blocks' integer sums as floats). A NaN or inf in a block makes its
    scale NaN (x * 0 is NaN there only): the output goes NaN as a float dot's would, rather than the rounding to
    int8 silently dropping it. An all-zero block rounds to 0s."""
    amax = tl.max(tl.abs(xb), axis=1)
    xi = tl.floor(xb * (127.0 / tl.maximum(amax, 1e-30))[:, None] + 0.5).to(tl.int32)
    return xi, amax / 127.0 + tl.sum(xb * 0.0, axis=1), tl.sum(xi, axis=1).to(tl.float32)


@triton.jit
def _x_int8(xf, BLOCK_K: tl.constexpr, XB: tl.constexpr):
    """x [BLOCK_K] float32 as int8 in blocks of XB columns, scaled to each block's largest magnitude: (even-column
    bytes, odd-column bytes) packed four to an int32 to meet the low / high nibbles of a weight word, the block
    scales and the blocks' integer sums (as floats)."""
    xi, scale, sums = _int8_blocks(tl.reshape(xf, (BLOCK_K // XB, XB)))
    even, odd = tl.split(tl.reshape(xi, (BLOCK_K // 8, 4, 2)))
    shift = (tl.arange(0, 4) * 8)[None, :]  # disjoint bytes: the sums are ORs
    return tl.sum((even & 0xFF) << shift, axis=1), tl.sum((odd & 0xFF) << shift, axis=1), scale, sums


@triton.jit
def _int4_row_dots(w, s, o, xq, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, XB: tl.constexpr):
    """W · x for int4 rows (int32 words) and x from _x_int8 (blocks of XB columns) or _packed_x. Exact integer
    sums a block, then sum((q s + o) x) = x_scale (s sum(q xi) + o sum(xi)) a block: about a fifth of the
    instructions of meeting every nibble with a float (a 4-row program: 2 words, 4 dp4a, 3 masks per 16 weights)."""
    x_even, x_odd, x_scale, x_sums = xq
    dots = _dp4a(
        (w >> 4) & 0x0F0F0F0F,
        tl.broadcast_to(x_odd[None, :], w.shape),
        _dp4a(w & 0x0F0F0F0F, tl.broadcast_to(x_even[None, :], w.shape), tl.zeros(w.shape, tl.int32)),
    )
    PER_GROUP: tl.constexpr = GROUP // XB
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    blocks = tl.reshape(
        tl.sum(tl.reshape(dots, (BLOCK_N, BLOCK_K // XB, XB // 8)), axis=2), (BLOCK_N, GROUPS, PER_GROUP)
    ).to(tl.float32)
    x_sums = tl.reshape(x_sums, (GROUPS, PER_GROUP))[None, :, :]
    x_scale = tl.reshape(x_scale, (GROUPS, PER_GROUP))[None, :, :]
    return tl.sum(tl.sum(x_scale * (s[:, :, None] * blocks + o[:, :, None] * x_sums), axis=2), axis=1)


@triton.jit
def _row_dots(
    w, s, o, x, WKIND: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, XB: tl.constexpr
):
    """W · x for the rows _load_rows returned: x [BLOCK_K] float32 (zero past K), or for int4 rows _x_int8 of it
    (blocks of XB columns) or _packed_x."""
    if WKIND == 2:
        acc = _int4_row_dots(w, s, o, x, GROUP, BLOCK_N, BLOCK_K, XB)
    else:
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if WKIND == 1:
            acc = acc * s
    return acc


@triton.jit
def _x_piece(x_ptr, res_ptr, res_out_ptr, row, ROWS, K, k, pid, HAS_RES: tl.constexpr, dtype: tl.constexpr):
    """x[row] (+ res[row]) at columns k, in float32 (0 past K); the n-block 0 programs store the sum as the new
    residual."""
    k_ok = (k < K) & (k * 0 + row < ROWS)  # masks as tensors: the interpreter rejects scalar conditions
    x = tl.load(x_ptr + row * K + k, mask=k_ok, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * K + k, mask=k_ok, other=0.0).to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * K + k, x, mask=k_ok & (k * 0 + pid == 0))
    return x.to(tl.float32)


# A GEMV can hand the int4 GEMV after it x already rounded (PackedX): a row of K columns is [even-column words K/8 |
# odd-column words K/8 | block scales K/16 | block integer sums K/16 | sums of squares, a producer program each],
# blocks of PACKED_BLOCK columns (one producer program holds whole blocks), so the consumer's programs skip the
# norm's reduction and the rounding that each of them would otherwise repeat over the whole row.
PACKED_BLOCK = tl.constexpr(16)


@triton.jit
def _packed_x(row_ptr, K, k0, row, ROWS, BLOCK_K: tl.constexpr):
    """_x_int8's four parts for columns k0 .. k0 + BLOCK_K of the PackedX row at row_ptr (float32), 0 past K."""
    i = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    b = k0 // PACKED_BLOCK + tl.arange(0, BLOCK_K // PACKED_BLOCK)
    i_ok, b_ok = (i < K // 8) & (i * 0 + row < ROWS), (b < K // PACKED_BLOCK) & (b * 0 + row < ROWS)
    words = row_ptr.to(tl.pointer_type(tl.int32))
    return (
        tl.load(words + i, mask=i_ok, other=0),
        tl.load(words + K // 8 + i, mask=i_ok, other=0),
        tl.load(row_ptr + K // 4 + b, mask=b_ok, other=0.0),
        tl.load(row_ptr + K // 4 + K // PACKED_BLOCK + b, mask=b_ok, other=0.0),
    )


@triton.jit
def _packed_rms(row_ptr, K, parts, eps, row, ROWS, P_BLOCK: tl.constexpr):
    """1 / rms of the row whose PackedX is at row_ptr, from its producer programs' sums of squares."""
    p = tl.arange(0, P_BLOCK)
    sq = tl.load(row_ptr + K // 4 + K // 8 + p, mask=(p < parts) & (p * 0 + row < ROWS), other=0.0)
    return tl.rsqrt(tl.sum(sq, axis=0) / K + eps)


@triton.jit
def _store_packed(
    acc,
    out_ptr,
    res_ptr,
    res_out_ptr,
    nwq,
    row,
    ROWS,
    N_OUT,
    n,
    n_ok,
    pid,
    QRES: tl.constexpr,
    QNORM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    Q_PBLOCK: tl.constexpr,
):
    """Program pid's outputs acc [BLOCK_N] of a row as the PackedX of the next projection's input: QRES adds the
    residual (and stores the sum as the new residual), QNORM stores its sum of squares and multiplies by the next
    norm's weight nwq (the next GEMV applies 1 / rms to its dots: rounding in blocks does not see a row's scale)."""
    ok = n_ok & (n * 0 + row < ROWS)
    y = acc.to(tl.float32)
    if QRES:
        y = (y + tl.load(res_ptr + row * N_OUT + n, mask=ok, other=0.0).to(tl.float32)).to(acc.dtype)
        tl.store(res_out_ptr + row * N_OUT + n, y, mask=ok)
        y = y.to(tl.float32)
    row_ptr = out_ptr + row * (N_OUT // 4 + N_OUT // 8 + Q_PBLOCK)
    if QNORM:
        one = tl.arange(0, 1)
        tl.store(
            row_ptr + N_OUT // 4 + N_OUT // 8 + pid + one,
            tl.sum(y * y, axis=0) + tl.zeros([1], tl.float32),
            mask=one * 0 + row < ROWS,
        )
        y = y * nwq
    even, odd, scale, sums = _x_int8(y, BLOCK_N, PACKED_BLOCK)
    i = pid * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    b = pid * (BLOCK_N // PACKED_BLOCK) + tl.arange(0, BLOCK_N // PACKED_BLOCK)
    i_ok, b_ok = (i < N_OUT // 8) & (i * 0 + row < ROWS), (b < N_OUT // PACKED_BLOCK) & (b * 0 + row < ROWS)
    words = row_ptr.to(tl.pointer_type(tl.int32))
    tl.store(words + i, even, mask=i_ok)
    tl.store(words + N_OUT // 8 + i, odd, mask=i_ok)
    tl.store(row_ptr + N_OUT // 4 + b, scale, mask=b_ok)
    tl.store(row_ptr + N_OUT // 4 + N_OUT // PACKED_BLOCK + b, sums, mask=b_ok)


@triton.jit
def _norm_gemv_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    nw_ptr,
    w_ptr,
    scales_ptr,
    offsets_ptr,
    out_ptr,
    live_ptr,
    ROWS,
    K,
    N_OUT,
    eps,
    X_PARTS,
    HAS_NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    SILU: tl.constexpr,
    WKIND: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    LIVE: tl.constexpr,
    PDL: tl.constexpr,
    PACKED: tl.constexpr,
    P_BLOCK: tl.constexpr,
    QOUT: tl.constexpr,
    QRES: tl.constexpr,
    QNORM: tl.constexpr,
    Q_PBLOCK: tl.constexpr,
):
    """out[row] = W · rmsnorm(x[row] (+ res[row])), the whole row in registers; SILU folds silu(gate) * up in.

    Program (n block, row block) holds BLOCK_N rows of W and the norm weight (read before the wait for the
    producer of x) and applies them to ROW_BLOCK rows of x, unrolled and independent: every row runs the same
    instructions a one-row call runs, so its result is bit-equal whatever ROWS and ROW_BLOCK are (a speculative
    verify step reproduces decode).
    The row is held as columns 0 .. BLOCK_K and, when BLOCK_KB > 0, BLOCK_K .. BLOCK_K + BLOCK_KB (see
    gemv_k_pieces). With SILU the weight is gate rows then up rows ([2 * N_OUT, K]) and out is [rows, N_OUT]. The
    n-block 0 programs write the new residual; the others only read the old one, so the output buffer must differ
    from the input. Weights are read as WKIND says (see _load_rows); int4 rows meet x as int8 blocks (_x_int8),
    as llama.cpp's quantized GEMVs do: per-row numerics, so row invariance holds for them as for the others.
    PACKED: x is a PackedX (int4 W; X_PARTS sums of squares, P_BLOCK a power of two >= X_PARTS): its rounding and
    with HAS_NORM the norm's weight and residual are done, 1 / rms is applied to the dots. QOUT: out is the PackedX
    of the next int4 GEMV's input (_store_packed; QRES: res_ptr / res_out_ptr are the residual of the outputs,
    QNORM: nw_ptr the next norm's weight, Q_PBLOCK the next call's P_BLOCK).
    LIVE (ROW_BLOCK 1): a row whose live_ptr entry (its context length) is 0, a verify step's row past its drafts
    or a bucket's padding row, is not computed: nothing reads it, and its output and residual rows are left as
    they were, so a step costs the rows it really has.
    """
    pid, first_row = tl.program_id(0), tl.program_id(1) * ROW_BLOCK
    TWO: tl.constexpr = BLOCK_KB > 0
    XB: tl.constexpr = PACKED_BLOCK if PACKED else X_BLOCK
    NORM_X: tl.constexpr = HAS_NORM and not PACKED
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N_OUT
    if LIVE:  # gates the rows' work only: the weight reads below must not wait for this load
        go = tl.load(live_ptr + first_row) != 0
    else:
        go = True
    w, s, o = _load_rows(w_ptr, scales_ptr, offsets_ptr, n, n_ok, K, 0, WKIND, GROUP, BLOCK_N, BLOCK_K)
    if TWO:
        wb, sb, ob = _load_rows(w_ptr, scales_ptr, offsets_ptr, n, n_ok, K, BLOCK_K, WKIND, GROUP, BLOCK_N, BLOCK_KB)
    if SILU:
        up_n = n + N_OUT
        w_up, s_up, o_up = _load_rows(w_ptr, scales_ptr, offsets_ptr, up_n, n_ok, K, 0, WKIND, GROUP, BLOCK_N, BLOCK_K)
        if TWO:
            w_upb, s_upb, o_upb = _load_rows(
                w_ptr, scales_ptr, offsets_ptr, up_n, n_ok, K, BLOCK_K, WKIND, GROUP, BLOCK_N, BLOCK_KB
            )
    k = tl.arange(0, BLOCK_K)
    if TWO:
        kb = BLOCK_K + tl.arange(0, BLOCK_KB)
    if NORM_X:
        nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        if TWO:
            nwb = tl.load(nw_ptr + kb, mask=kb < K, other=0.0).to(tl.float32)
    if QNORM:
        nwq = tl.load(nw_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    else:
        nwq = 1.0
    _after_producer(PDL)
    dtype = res_out_ptr.dtype.element_ty if QOUT else out_ptr.dtype.element_ty
    if go:
        for i in tl.static_range(ROW_BLOCK):
            row = first_row + i
            if PACKED:
                row_ptr = x_ptr + row * (K // 4 + K // 8 + P_BLOCK)
                xf = _packed_x(row_ptr, K, 0, row, ROWS, BLOCK_K)
                if TWO:
                    xfb = _packed_x(row_ptr, K, BLOCK_K, row, ROWS, BLOCK_KB)
                rms = _packed_rms(row_ptr, K, X_PARTS, eps, row, ROWS, P_BLOCK) if HAS_NORM else 1.0
            else:
                xf = _x_piece(x_ptr, res_ptr, res_out_ptr, row, ROWS, K, k, pid, HAS_RES, dtype)
                if TWO:
                    xfb = _x_piece(x_ptr, res_ptr, res_out_ptr, row, ROWS, K, kb, pid, HAS_RES, dtype)
                if HAS_NORM:
                    sum_sq = tl.sum(xf * xf, axis=0)
                    if TWO:
                        sum_sq += tl.sum(xfb * xfb, axis=0)
                    rms = tl.rsqrt(sum_sq / K + eps)
                    xf = (xf * rms * nw).to(dtype).to(tl.float32)
                    if TWO:
                        xfb = (xfb * rms * nwb).to(dtype).to(tl.float32)
                if WKIND == 2:  # rounded to int8 once a row piece, for gate and up alike
                    xf = _x_int8(xf, BLOCK_K, XB)
            acc = _row_dots(w, s, o, xf, WKIND, GROUP, BLOCK_N, BLOCK_K, XB)
            if TWO:
                if WKIND == 2 and not PACKED:
                    xfb = _x_int8(xfb, BLOCK_KB, XB)
                acc += _row_dots(wb, sb, ob, xfb, WKIND, GROUP, BLOCK_N, BLOCK_KB, XB)
            if PACKED and HAS_NORM:
                acc = acc * rms
            acc = acc.to(dtype)
            if SILU:
                up = _row_dots(w_up, s_up, o_up, xf, WKIND, GROUP, BLOCK_N, BLOCK_K, XB)
                if TWO:
                    up += _row_dots(w_upb, s_upb, o_upb, xfb, WKIND, GROUP, BLOCK_N, BLOCK_KB, XB)
                if PACKED and HAS_NORM:
                    up = up * rms
                gate = acc.to(tl.float32)
                acc = ((gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)
            if QOUT:
                _store_packed(
                    acc,
                    out_ptr,
                    res_ptr,
                    res_out_ptr,
                    nwq,
                    row,
                    ROWS,
                    N_OUT,
                    n,
                    n_ok,
                    pid,
                    QRES,
                    QNORM,
                    BLOCK_N,
                    Q_PBLOCK,
                )
            else:
                tl.store(out_ptr + row * N_OUT + n, acc, mask=n_ok & (n * 0 + row < ROWS))


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


@triton.jit
def _store_int8_groups(x, first, K, data_ptr, scale_ptr, sum_ptr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """One row's Int8Rows at columns first .. first + BLOCK (first on a group boundary) of x (float32 [BLOCK], 0
    past K), row pointers given: each group rounded to int8 at its largest magnitude / 127, its even columns
    stored before its odd ones (the order _int4_int8_step reads), its scale and the sum of its integers
    (_int8_blocks: the int4 GEMV's rounding)."""
    xi, scale, sums = _int8_blocks(tl.reshape(x, (BLOCK // GROUP, GROUP)))
    cols = first + tl.arange(0, BLOCK)
    j = cols % GROUP
    tl.store(data_ptr + cols - j + (j % 2) * (GROUP // 2) + j // 2, tl.reshape(xi, (BLOCK,)).to(tl.int8), mask=cols < K)
    g = first // GROUP + tl.arange(0, BLOCK // GROUP)
    tl.store(scale_ptr + g, scale, mask=g * GROUP < K)
    tl.store(sum_ptr + g, sums, mask=g * GROUP < K)


@triton.jit
def _int4_tile(
    packed_ptr,
    scales_ptr,
    offsets_ptr,
    rows,
    rows_ok,
    K,
    first,
    GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Int4Weight rows `rows`, columns first .. first + BLOCK_K (a multiple of GROUP; 0 past K), as float32 values
    q * scale + offset: byte i's nibbles (columns 2i, 2i + 1) interleaved in registers by join. EVEN_K: the tile
    lies inside K, so the loads take row masks only (a mask along K keeps a GEMM's loads out of its software
    pipeline: H200, Qwen3 int4 batch-8 step 1,388 us with it, 1,268 without)."""
    half = first // 2 + tl.arange(0, BLOCK_K // 2)
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    g = first // GROUP + tl.arange(0, GROUPS)
    if EVEN_K:
        p_ok, g_ok = rows_ok[:, None], rows_ok[:, None]
    else:
        p_ok = rows_ok[:, None] & (half < K // 2)[None, :]
        g_ok = rows_ok[:, None] & (g < K // GROUP)[None, :]
    p = tl.load(packed_ptr + rows[:, None] * (K // 2) + half[None, :], mask=p_ok, other=0)
    q = tl.reshape(tl.join(p & 0xF, p >> 4), (BLOCK_R, BLOCK_K)).to(tl.float32)
    s = tl.load(scales_ptr + rows[:, None] * (K // GROUP) + g[None, :], mask=g_ok, other=0.0)
    o = tl.load(offsets_ptr + rows[:, None] * (K // GROUP) + g[None, :], mask=g_ok, other=0.0)
    return tl.reshape(tl.reshape(q, (BLOCK_R, GROUPS, GROUP)) * s[:, :, None] + o[:, :, None], (BLOCK_R, BLOCK_K))


@triton.jit
def _int4_dequant_kernel(
    packed_ptr,
    scales_ptr,
    offsets_ptr,
    out_ptr,
    N,
    K,
    GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """One pass from Int4Weight to a 16-bit [N, K] weight (then a GEMM): a program takes BLOCK_R rows x BLOCK_K
    columns; byte i's nibbles (columns 2i, 2i + 1) are interleaved in registers, so each thread stores contiguous
    16-bit runs (a program a row with two stride-2 stores took twice as long on an H200).

    Under programmatic dependent launch it waits for its producer (the buffer it writes may be the one the GEMM
    before it reads) but releases the GEMM after it only at its end: released at the start, that GEMM's programs
    sit waiting on SMs this pass, several waves long, still needs (H200, Qwen3 shape, int4 batch-8 step: 1,955 us
    against 1,352)."""
    if PDL:
        gdc_wait()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    first = tl.program_id(1) * BLOCK_K
    rows_ok = rows < N
    w = _int4_tile(packed_ptr, scales_ptr, offsets_ptr, rows, rows_ok, K, first, GROUP, BLOCK_R, BLOCK_K, False)
    cols = first + tl.arange(0, BLOCK_K)
    tl.store(
        out_ptr + rows[:, None] * K + cols[None, :],
        w.to(out_ptr.dtype.element_ty),
        mask=rows_ok[:, None] & (cols < K)[None, :],
    )
    if PDL:
        gdc_launch_dependents()


# ---------------------------------------------------------------------------------------------------------------
# Decode-step bookkeeping on the device (graph replays feed themselves)


@triton.jit
def _argmax_key(value, index):
    """(value, index) packed in an int64 ordered by value, then by the lower index (torch.argmax returns the first
    of equal maxima): the float's bits made monotonic as an unsigned 32-bit number, above 31 bits of
    2^31 - 1 - index. Positive, so 0 is below every key."""
    bits = value.to(tl.int32, bitcast=True)
    monotonic = tl.where(bits < 0, ~bits, bits | -2147483648).to(tl.int64) & 0xFFFFFFFF
    return (monotonic << 31) | (2147483647 - index.to(tl.int64))


@triton.jit
def _argmax_token(keys):
    """The token of the best of argmax_keys' keys along axis 1 (the index _argmax_key packed)."""
    return 2147483647 - (tl.max(keys, axis=1) & 2147483647)


@triton.jit
def _argmax_chunks_kernel(x_ptr, keys_ptr, N, CHUNK, CHUNKS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """First half of a greedy step's argmax: the best key of each chunk of each row (decode_advance takes the
    rest). Many programs where torch's argmax gives a vocabulary-sized row to one."""
    _after_producer(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    j = tl.arange(0, BLOCK)
    i = chunk * CHUNK + j
    ok = (j < CHUNK) & (i < N)
    value = tl.load(x_ptr + row * N + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(keys_ptr + row * CHUNKS + chunk, tl.max(tl.where(ok, _argmax_key(value, i), 0), axis=0))


@triton.jit
def _decode_inputs_kernel(
    pos_ptr,
    live_ptr,
    tables_ptr,
    slot_ptr,
    ctx_ptr,
    rows,
    width,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    _after_producer(PDL)
    r = tl.arange(0, BLOCK)
    m = r < rows
    pos = tl.load(pos_ptr + r, mask=m, other=0)
    live = tl.load(live_ptr + r, mask=m, other=0) != 0
    block = tl.load(tables_ptr + r * width + tl.minimum(pos // BLOCK_SIZE, width - 1), mask=m & live, other=0)
    tl.store(slot_ptr + r, tl.where(live, block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, -1), mask=m)
    tl.store(ctx_ptr + r, tl.where(live, pos + 1, 0).to(tl.int32), mask=m)


@triton.jit
def _decode_advance_kernel(
    tok_ptr,
    ids_ptr,
    pos_ptr,
    out_ptr,
    step_ptr,
    rows,
    out_stride,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Sampled tokens become the next inputs and land in row `step` of the output; positions and step advance.
    CHUNKS > 0: tok_ptr holds argmax_keys' [rows, CHUNKS] keys, whose maximum per row is the token; they are set
    back to zeros, as greedy_keys wants them next step."""
    _after_producer(PDL)
    r = tl.arange(0, BLOCK)
    m = r < rows
    step = tl.load(step_ptr)
    if CHUNKS > 0:
        keys = tok_ptr + r[:, None] * CHUNKS + tl.arange(0, CHUNKS)[None, :]
        tok = _argmax_token(tl.load(keys, mask=m[:, None], other=0))
        tl.store(keys, tl.zeros([BLOCK, CHUNKS], tl.int64), mask=m[:, None])
    else:
        tok = tl.load(tok_ptr + r, mask=m)
    tl.store(out_ptr + step * out_stride + r, tok, mask=m)
    tl.store(ids_ptr + r, tok, mask=m)
    tl.store(pos_ptr + r, tl.load(pos_ptr + r, mask=m) + 1, mask=m)
    tl.store(step_ptr, step + 1)


# ---------------------------------------------------------------------------------------------------------------


def skinny_config(n: int, k: int, rows: int, elem_bytes: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, pipeline stages, K slices) for weights of elem_bytes bytes an element: the fastest of
    sweeps on an H200 at 1, 8 and 64 rows (docs/benchmarks.md). Long rows at small batches (Qwen3's down
    projection, K = 3,072, up to 16 rows) stream in four K slices: 7.0 -> 5.8 us a call in bf16 at 8 rows, 5.8 ->
    5.2 in fp8 (measured at 8 rows); elsewhere, 64 rows included, slices were no faster. Above 16 rows (programs
    of 64 rows of x: skinny_block_m) a K step spans 256 bytes of a weight row where N >= 4,096 and 512 elsewhere,
    fp8 and bf16 alike, and the widest projection (gate/up, N >= 6,144) takes 64 rows a program (H200, Qwen3 at 64
    rows, us a call, fp8 with its activations already fp8: qkv 3.78 -> 3.34, gate_up 4.61 -> 4.33, down 4.85 ->
    4.72; bf16 gate_up 6.16 -> 5.78).

    Vocabulary projections (N > GEMV_MAX_N): 64 rows a program, 256 bytes of a row a step (fp8 past 32 rows: 128),
    three stages. H200, Qwen3's head with its norm: fp8 writing logits within 1% of the fastest of 18 configs at
    each of 8, 16, 32 and 64 rows (47.6, 48.2, 50.8, 54.9 us; torch._scaled_mm 66.1, 66.0, 64.1, 60.2), and at 64
    rows writing greedy_keys' keys 62.9 -> 55.5 us for the shorter step (logits 54.6 -> 54.4; 8-16 rows 1-5 us
    slower with it); bf16 keys the fastest of 9 configs at 8, 16 and 32 rows and 1.4% off it at 64."""
    stages = 4
    if n > GEMV_MAX_N:
        block_n, block_k, stages = 64, (128 if elem_bytes == 1 and rows > 32 else 256) // elem_bytes, 3
    elif k >= 3072 and rows <= 16 and k % 1024 == 0:
        return 32, 256, 3, 4
    elif k >= 3072 and rows <= 16 and k % 512 == 0 and elem_bytes == 2:
        return 32, 128, 3, 4  # Qwen3-4B's down projection, K = 9,728: 20.3 vs 24.9 us at 8 rows, 20.9 vs 24.6 at 16
    elif rows > 16:
        block_k = (256 if n >= 4096 else 512) // elem_bytes
        block_n = 64 if n >= 6144 else 32 if n >= 4096 else 16
    else:
        block_k = 128 if n >= 4096 else 256
        block_n = 32 if n >= 4096 else 16
    while k % block_k:
        block_k //= 2
    return block_n, block_k, stages, 1


def int4_skinny_config(k: int, rows: int, group: int) -> tuple[int, int, int, int] | None:
    """skinny_config for int4 weights widened in the K loop: 256 columns a step (halved until they divide K), 32
    weight rows a program up to 16 rows of x, 16 above, three stages (the fastest by sum over Qwen3's four
    projections in a sweep of 10 configs at 5, 8, 16 and 32 rows on an H200). Rows of 1,536+ columns (the o and down
    projections, whose 576-1,024 outputs make few programs) take 16 weight rows a program and K in two slices, four
    above 16 rows where K >= 2,048 (H200, captured int4 steps: Qwen3 8 rows 1,269.9 -> 1,158.0 us, 16: 1,370.2 ->
    1,204.9, 32: 1,854.9 -> 1,766.5; SmolLM2 8: 818.5 -> 796.3, 16: 868.3 -> 842.4, 32: 967.9 -> 957.0). None where
    no step of whole groups divides K."""
    block_k = 256
    while k % block_k and block_k > group:
        block_k //= 2
    if k % block_k or block_k % group:
        return None
    if k >= 1536:
        return 16, block_k, 3, 4 if rows > 16 and k >= 2048 else 2
    return (32 if rows <= 16 else 16), block_k, 3, 1


def int4_wide_config(n: int, k: int, rows: int, group: int) -> tuple[int, int, int, int] | None:
    """skinny_config for large int4 weights widened as the dot's first operand (W_AS_A; _wide_int4 says where):
    64 weight rows a program (one wgmma tile), 256 columns a step and K in two slices; the widest weights (gate/up,
    outputs >= 4 x K) 128 columns and two stages, qkv-like ones of 6,144+ outputs (96+ programs) one slice above
    32 rows. The fastest of 31 configs, or within 2% of it, on Qwen3 1.7B / 4B / 8B's weights at 32, 48 and 64 rows
    but 1.7B's gate/up (8%: three stages there; H200). Steps are halved until they
    divide K; None where no step of whole groups does."""
    block_k = 128 if n >= 4 * k else 256
    while k % block_k and block_k > group:
        block_k //= 2
    if k % block_k or block_k % group:
        return None
    if n >= 4 * k:
        return 64, block_k, 2, 2
    return 64, block_k, 3, 1 if rows > 32 and k < n and n >= 6144 else 2


def int4_int8_config(n: int, k: int, rows: int, group: int) -> tuple[int, int, int, int]:
    """skinny_config for int4 weights meeting Int8Rows (large ones: _meets_int8_rows). Up to 16 rows, 32 weight
    rows a program: rows at least as long as the outputs are many (o, down) 512 columns a step where 1,024 divide
    K (else 256), K in two slices where it is twice the outputs; the widest (gate/up, outputs >= 4 x K) 128
    columns, one slice, 64 weight rows and three stages from K = 4,096; the rest (qkv) 256 columns in two
    slices. The fastest of 54 configs at 2 / 4 / 8 / 16 rows on Qwen3 1.7B / 4B / 8B's large weights, or within 7%
    of it, but 1.7B's qkv (12-18%: one rule for qkv; H200). 17-32 rows (programs
    of 32 rows of x; the weights the wide route leaves them: gate/up, and 1.7B's down with its 2,048 outputs): 64
    weight rows, 256 columns and three stages, K in two slices (the fastest of 11 configs at 24 and 32 rows for
    1.7B's gate/up and down, 17-19% and 8% ahead of 128 columns in four stages; within 2% of the fastest for 4B's
    and 8B's gate/up). Steps are halved until they divide K (a group divides it)."""
    if rows > 16:
        block_n, block_k, stages, split_k = 64, 256, 3, 2
    elif k >= n:
        block_n, block_k, stages, split_k = 32, (512 if k % 1024 == 0 else 256), 3, (2 if k >= 2 * n else 1)
    elif n >= 4 * k:
        block_n, block_k, stages, split_k = (64, 128, 3, 1) if k >= 4096 else (32, 128, 4, 1)
    else:
        block_n, block_k, stages, split_k = 32, 256, 3, 2
    while k % block_k and block_k > group:
        block_k //= 2
    return block_n, block_k, stages, split_k


def paged_config(dim: int, e5m2: bool, decode: bool) -> tuple[int, int, int]:
    """(keys a tile, warps, pipeline stages) of the paged attention kernel. Decode steps (one query row a
    sequence) with head_dim 128: 64 keys, two warps (the fastest of a sweep on an H200 at batch 64, context 320:
    bf16 cache 24.9 us a layer vs 25.7 for four warps; fp8-e5m2 21.1, four stages, vs 28.9 for four warps)."""
    if decode and dim <= 128:
        return 64, 2, 4 if e5m2 else 3
    return (64 if dim <= 128 else 32), 4, 3


def skinny_block_m(rows: int, kind: int) -> int:
    """Rows of x a skinny GEMM program takes: 64, the wgmma's tile, for 17-64 rows of 16-bit or fp8 weights (with
    skinny_config's >16-row steps; H200, Qwen3 captured steps against tiles of 32 rows and the <=16-row steps:
    bf16 batch 24 1,375.9 -> 1,305.1 us, 32 1,569.0 -> 1,449.3; fp8 + e5m2 24 1,316.7 -> 1,226.4, 32 1,219.7 ->
    1,149.4); else the rows' next power of two, 16 at least (the mma's). Int4 tiles, widened in registers, keep
    the latter (64 rows: batch 24 1,579.4 -> 1,826.9 us)."""
    if 16 < rows <= 64 and kind != INT4:
        return 64
    return max(16, _pow2(rows))


def silu_fp8_group(n: int) -> int:
    """Columns a scale covers in silu_and_mul_fp8's grouped rows of n columns: one program's block."""
    return min(1024, _pow2(n))


def heads_per_scale(group: int) -> int:
    """Heads of a kv group that share one fp8 scale in the o projection's input: the whole group where it is a
    power of two (the skinny GEMM's groups are), else one. Fewer, wider groups are fewer partial products to scale
    (H200, Qwen3's pairs of heads against a scale a head, captured fp8 + e5m2 steps: 64 rows 1,252.3 -> 1,241.4 us,
    48 rows 1,200.0 -> 1,191.4)."""
    return group if _pow2(group) == group else 1


def e5m2_decode_config(dim: int) -> tuple[int, int, int]:
    """(keys a tile, warps, pipeline stages) of _decode_e5m2_kernel: 128 keys, four warps, two stages up to
    head_dim 128 (the fastest of 24 configs on an H200 at batch 64, contexts 256-382: Qwen3 16.0 us a layer, 64
    keys 19.6-20.5, two warps 17.3-17.7, 256 keys 22.7-32.5; SmolLM2 8.5 vs 10.9-11.6 for 64 keys); a tile of the
    same bytes past it."""
    return (128 if dim <= 128 else 64), 4, 2


def gemv_config(n_out: int, k: int, kind: int = DENSE) -> tuple[int, int]:
    """(rows of W per program, warps). Four rows and four warps gave the fastest batch-1 decode step on an H200 for
    the Qwen3-0.6B shape (programmatic dependent launch on; the sweep in docs/benchmarks.md). Small 16-bit weights
    (the SmolLM2-135M layers) run faster with eight rows, in decode and verify steps alike (SmolLM2 shape, batch-1
    decode step: bf16 358 vs 386 us; K = 4 verify 693 vs 726); small fp8 ones do not (364 vs 340). Int4 rows cost
    few instructions (dp4a), so their programs take 16 (captured steps: Qwen3 batch 1 with eight warps 571 us vs
    602 for four rows and four warps; SmolLM2 decode 344 vs 365, verify 572 vs 614, four warps). A function of the
    weight alone, so that decode and verify rows of one layer round alike."""
    if kind != INT4 and k > GEMV_MAX_K:  # LONG_GEMV_MAX_K's 16-bit and fp8 rows: 4 x 4 spilled at 8B's 12,288
        return 2, 4  # bf16 (7,048 vs 4,099 us a step); 2 x 4 was within 4% of the fastest of six elsewhere
    small = _small_weight(n_out, k)
    if kind == INT4:  # rows past GEMV_MAX_K, 6,144 / 9,728 / 12,288 columns: 3.9 / 6.8 / 13.2 us vs 3.9 / 8.7 / 14.5
        return (16, 4) if small or k > GEMV_MAX_K else (16, 8)  # in 16 x 8 (both in two pieces)
    return (8, 4) if small and kind != FP8 else (4, 4)


def gemv_k_pieces(n_out: int, k: int, group: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_KB): a GEMV row as a power-of-two piece plus a second one for the rest, so that a 576-wide
    row takes 512 + 64 columns' registers rather than 1,024 (BLOCK_KB 0: one piece); group > 1 means int4 rows,
    whose pieces hold whole groups. Two pieces for small weights (SmolLM2 shape, H200, captured steps: bf16 decode
    345 vs 357 us, int4 396 vs 420), rows past GEMV_MAX_K (int4 at one row, 16 rows and four warps a program:
    9,728 = 8,192 + 2,048 columns 6.8 vs 17.8 us in one piece of 16,384; 12,288 13.2 vs 25.6), every int4 row
    that is not a power of two (the dots, not the bytes, bound them: Qwen3-4B's 2,560 = 2,048 + 512 columns, int4
    step 1,701 -> 1,561 us; 0.6B's 3,072 = 2,048 + 1,024, 569 -> 560) and 16-bit or fp8 rows one piece would pad by
    more than a quarter (4B bf16 2,724 -> 2,582 us; 0.6B's 3,072 pads by a quarter and ran 0.7% slower in two, fp8
    1.6%)."""
    first = 1 << (k.bit_length() - 1)
    rest = _pow2(k - first) if first < k else 0
    if rest == 0 or rest % group:
        return _pow2(k), 0
    wasteful = group > 1 or 4 * k < 3 * _pow2(k)
    if not _small_weight(n_out, k) and k <= GEMV_MAX_K and not wasteful:
        return _pow2(k), 0
    return first, rest


def _meets_int8_rows(w: Int4Weight) -> bool:
    """Large int4 weights (the layers of 1.7B and larger models) whose groups are a power of two of at least 64
    columns meet Int8Rows of their group in the skinny GEMM (each half of a group fills an int8 mma step of
    32), which streams them 1.7-2.6x faster at 4 rows than widening their nibbles to bf16 there. Others are
    widened (GGUF's 32-column blocks; the smaller weights of Qwen3-0.6B, whose captured steps of 8-32 rows ran
    5-8% slower with Int8Rows: H200)."""
    g = w.group_size
    return g >= 64 and g & (g - 1) == 0 and _large_weight(*w.shape)


def _small_weight(n_out: int, k: int) -> bool:
    """Under 2^21 elements (4 MiB in 16 bits): the layers of SmolLM2-135M are, those of Qwen3-0.6B are not."""
    return n_out * k < 1 << 21


def _large_weight(n_out: int, k: int) -> bool:
    """At least LARGE_WEIGHT elements: the layers of 1.7B and larger models."""
    return n_out * k >= LARGE_WEIGHT


def gemv_row_block(rows: int, n_out: int, k: int) -> int:
    """Rows of x one GEMV program applies its W tile to, unrolled: more rows share a tile, fewer when the row is
    long (registers). A small weight gives each row programs of its own: L2 serves the re-reads and the rows run
    in parallel (a SmolLM2 K = 4 verify step: 726 vs 837 us; Qwen3's larger layers are faster shared: 1,693 vs
    1,769). Rows past GEMV_MAX_K fill the registers alone (H200, Qwen3-8B's int4 down projection: 4 rows sharing a
    program 149.9 us, one row 13.2), and large weights run faster a row a program too (LARGE_WEIGHT)."""
    if _small_weight(n_out, k) or k > GEMV_MAX_K or _large_weight(n_out, k):
        return 1
    return max(1, min(rows, 8 if k <= 2048 else 4))


def argmax_chunks(n: int) -> int:
    """argmax_keys' chunks a row of n logits: a power of 2, at most ARGMAX_CHUNKS."""
    return max(1, min(ARGMAX_CHUNKS, _pow2(n // ARGMAX_MIN_CHUNK + 1) // 2))


def _key_chunks(sampled: torch.Tensor) -> int:
    """The chunk count of argmax_keys' [rows, chunks] keys; 0 for [rows] sampled tokens."""
    return sampled.shape[1] if sampled.dim() == 2 else 0


@dataclass
class _QuantizedRows:
    """Activations a projection takes quantized, data [rows, K] with their scales: shaped as the rows they stand
    for, so routing code reads them as it reads a tensor."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device


@dataclass
class Fp8Rows(_QuantizedRows):
    """Activations quantized to fp8-e4m3 by the kernel that produced them (an rmsnorm, SiLU-and-mul or decode
    attention ahead of an fp8 projection), so the projection needs no quantization pass: data [rows, K], scale
    [rows, 1] per token, or with group > 0 (a power of two) [rows, ceil(K / group)], a scale per token and group
    of columns."""

    dtype: torch.dtype  # the activations' own 16-bit dtype: what the projection writes
    group: int = 0


def _empty_fp8_rows(rows: int, k: int, like: torch.Tensor, group: int = 0) -> Fp8Rows:
    """Fp8Rows to be written: a scale per token, or with group > 0 per token and group of columns."""
    scales = triton.cdiv(k, group) if group else 1
    return Fp8Rows(
        torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=like.device),
        torch.empty(rows, scales, dtype=torch.float32, device=like.device),
        like.dtype,
        group,
    )


@dataclass
class Int8Rows(_QuantizedRows):
    """Activations rounded to int8 a group of columns at a time (the group of the int4 weight they meet) by the
    kernel that produced them or a pass (CudaKernels.int8_quantize_rows): data [rows, K] int8, each group's
    even columns before its odd ones (_store_int8_groups), scale and sums [rows, K / group] float32 (a group's
    largest magnitude / 127, and the sum of its integers, which the weight's offsets multiply)."""

    sums: torch.Tensor
    dtype: torch.dtype  # the activations' own 16-bit dtype: what the projection writes
    group: int


def _empty_int8_rows(rows: int, k: int, like: torch.Tensor, group: int) -> Int8Rows:
    groups = (rows, k // group)
    return Int8Rows(
        torch.empty(rows, k, dtype=torch.int8, device=like.device),
        torch.empty(groups, dtype=torch.float32, device=like.device),
        torch.empty(groups, dtype=torch.float32, device=like.device),
        like.dtype,
        group,
    )


@dataclass
class PackedX:
    """A GEMV's output as the int4 GEMV after it takes it (_store_packed; layout at PACKED_BLOCK): data [rows,
    K / 4 + K / 8 + pow2(parts)] float32, parts the producer programs' sums of squares (0: no norm between)."""

    data: torch.Tensor
    k: int
    parts: int
    dtype: torch.dtype  # the activations' own 16-bit dtype: what the projection writes

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.k))

    @property
    def device(self) -> torch.device:
        return self.data.device


def _parts_block(parts: int) -> int:
    """The room a PackedX row keeps for its producer's sums of squares (the kernels' P_BLOCK / Q_PBLOCK)."""
    return _pow2(max(parts, 1))


def _empty_packed_x(rows: int, k: int, parts: int, dtype: torch.dtype, device) -> PackedX:
    return PackedX(
        torch.empty(rows, k // 4 + k // 8 + _parts_block(parts), dtype=torch.float32, device=device), k, parts, dtype
    )


class CudaKernels(ReferenceKernels):
    """Triton versions of the hot ops; sampling and embedding stay in PyTorch (already one or two launches)."""

    def __init__(self, decode_splits: int = 1, register_gemv: bool = True, pdl: bool | None = None):
        # KV splits for decode attention; the runner sets this per captured batch size (small batches need more
        # programs than sequences x kv heads to fill the GPU).
        self.decode_splits = decode_splits
        # Batches of up to gemv_max_rows rows through the register GEMV (norm and silu fused in) rather than the
        # skinny GEMM.
        self.register_gemv = register_gemv
        # 16-bit weights at decode batch sizes (up to SKINNY_MAX_ROWS rows) through the skinny GEMM rather than
        # cuBLAS: it starts under programmatic dependent launch, and a captured bf16 step on an H200 ran 1.07-1.16x
        # faster for it at batch 8-64 (Qwen3-0.6B shape), 1.21-1.26x (SmolLM2 shape).
        self.skinny_dense = True
        # The runner raises this while it captures the graphs of a speculative run (decode and K + 1-row verify
        # steps): the GEMV computes each row exactly as a one-row call does, whatever the row count...
        self.gemv_max_rows = GEMV_MAX_ROWS
        # ... and sets this: the vocabulary projection then goes through the skinny GEMM in 16-row tiles, which
        # computes each row as a one-row call does too (the GEMV did, at 82 us for a SmolLM2 K = 4 verify step's
        # five rows vs 22 for one; see skinny_gemm).
        self.row_invariant = False
        # Profile batch_invariant (set by the runner for eager steps and every graph): decode rows attend with the
        # prompt rows' tile configuration too, so a step's mix of rows changes no row's attention.
        self.batch_invariant = False
        # Row counts up to which large weights and long rows take the GEMV (see _gemv_fits); graph_settings sets
        # both for row-invariant graphs.
        self.large_gemv_rows = LARGE_GEMV_MAX_ROWS
        self.long_gemv_rows = LONG_GEMV_MAX_ROWS
        # Programmatic dependent launch: each kernel's programs start while the previous kernel drains, and the
        # GEMVs stream their weights meanwhile (a batch-1 step is ~200 short kernels; see _after_producer).
        use = pdl_supported() if pdl is None else pdl
        self._pdl = {"PDL": use, "launch_pdl": use}
        self._split_k: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # A GEMV whose output an int4 GEMV of long rows takes next writes it as that GEMV's PackedX (linear_into,
        # norm_linear; PACKED_X_MIN_K).
        self.packed_x = True

    def sample(self, logits, params):
        if params.all_greedy:  # argmax needs no fp32 copy of [rows, vocab] logits: widening is exact
            return logits.argmax(-1)
        return super().sample(logits, params)

    # --- norms ---------------------------------------------------------------------------------------------
    def rmsnorm(self, x, weight, eps):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty_like(x2)
        if x2.shape[0]:
            _rmsnorm_kernel[(x2.shape[0],)](
                x2, x2, x2, weight, out, x2.shape[1], eps, HAS_RES=False, BLOCK_K=_pow2(x2.shape[1]), **self._pdl
            )
        return out.view(x.shape)

    def add_rmsnorm(self, x, residual, weight, eps):
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        if x.shape[0]:
            _rmsnorm_kernel[(x.shape[0],)](
                x, residual, res_out, weight, out, x.shape[1], eps, HAS_RES=True, BLOCK_K=_pow2(x.shape[1]), **self._pdl
            )
        return out, res_out

    def add_rmsnorm_fp8(self, x, residual, weight, eps) -> tuple[Fp8Rows, torch.Tensor]:
        """rmsnorm(x (+ residual; None: x is the residual stream)) as per-token fp8-e4m3 rows, and the new
        residual: one pass where add_rmsnorm + fp8_quantize_rows take two."""
        out = _empty_fp8_rows(x.shape[0], x.shape[1], x)
        return out, self._quantized_norm(x, residual, weight, eps, out, FMAX=FP8_MAX["fp8-e4m3"])

    def _quantized_norm(self, x, residual, weight, eps, out: Fp8Rows | Int8Rows, **quantized) -> torch.Tensor:
        """rmsnorm(x (+ residual)) into out's data and scales (quantized: the kernel's FMAX, or INT8_GROUP and
        sum_ptr), one pass; returns the new residual (x itself when residual is None)."""
        rows, k = x.shape
        res_out = torch.empty_like(x) if residual is not None else x
        if rows:
            _rmsnorm_kernel[(rows,)](
                x,
                x if residual is None else residual,
                res_out,
                weight,
                x,
                k,
                eps,
                HAS_RES=residual is not None,
                BLOCK_K=_pow2(k),
                fp8_ptr=out.data,
                scale_ptr=out.scale,
                **quantized,
                **self._pdl,
            )
        return res_out

    def silu_and_mul_fp8(self, x, grouped: bool = False) -> Fp8Rows:
        """silu_and_mul as fp8-e4m3 rows: per token (one program a row; rows of 4,096+ padded columns take 16
        warps: H200, Qwen3's 3,072 at 64 rows 1.92 -> 1.59 us a call, 8 warps 1.70), or grouped, a scale per
        token and 1,024 columns, the programs silu_and_mul runs."""
        rows, n = x.shape[0], x.shape[1] // 2
        block = silu_fp8_group(n) if grouped else _pow2(n)
        out = _empty_fp8_rows(rows, n, x, block if grouped else 0)
        if rows:
            _silu_mul_kernel[(rows, out.scale.shape[1])](
                x.contiguous(),
                out.data,
                n,
                BLOCK=block,
                scale_ptr=out.scale,
                FMAX=FP8_MAX["fp8-e4m3"],
                num_warps=16 if block >= 4096 else 4,
                **self._pdl,
            )
        return out

    def add_rmsnorm_int8(self, x, residual, weight, eps, group: int) -> tuple[Int8Rows, torch.Tensor]:
        """rmsnorm(x (+ residual; None: x is the residual stream)) as Int8Rows of group columns, and the new
        residual: one pass."""
        out = _empty_int8_rows(x.shape[0], x.shape[1], x, group)
        return out, self._quantized_norm(x, residual, weight, eps, out, sum_ptr=out.sums, INT8_GROUP=group)

    def silu_and_mul_int8(self, x, group: int) -> Int8Rows:
        """silu_and_mul as Int8Rows of group columns, on silu_and_mul's grid."""
        rows, n = x.shape[0], x.shape[1] // 2
        out = _empty_int8_rows(rows, n, x, group)
        if rows:
            block = max(group, min(1024, _pow2(n)))
            _silu_mul_kernel[(rows, triton.cdiv(n, block))](
                x.contiguous(),
                out.data,
                n,
                BLOCK=block,
                scale_ptr=out.scale,
                sum_ptr=out.sums,
                INT8_GROUP=group,
                **self._pdl,
            )
        return out

    def int8_quantize_rows(self, x, group: int) -> Int8Rows:
        """x as Int8Rows of group columns (one pass), for a producer that cannot write them itself."""
        rows, k = x.shape
        out = _empty_int8_rows(rows, k, x, group)
        if rows:
            block = max(group, min(1024, _pow2(k)))
            _int8_quant_rows_kernel[(rows, triton.cdiv(k, block))](
                x.contiguous(), out.data, out.scale, out.sums, k, GROUP=group, BLOCK=block, **self._pdl
            )
        return out

    # --- attention block pieces ----------------------------------------------------------------------------
    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        k2, v2 = k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
        if k2.shape[0]:
            width = k2.shape[1]
            _store_kv_kernel[(k2.shape[0],)](
                k2,
                v2,
                k_cache,
                v_cache,
                slot_mapping,
                k2.stride(0),
                v2.stride(0),
                WIDTH=width,
                BLOCK=_pow2(width),
                **self._pdl,
            )

    def qkv_rope_store(
        self,
        qkv,
        q_norm,
        k_norm,
        eps,
        positions,
        cos_sin,
        k_cache,
        v_cache,
        slot_mapping,
        num_heads,
        num_kv_heads,
        head_dim,
    ) -> torch.Tensor:
        """Merged qkv rows [T, (H + 2 KV) D] -> rotated q [T, H, D]; rotated k and v go straight into the cache."""
        q = torch.empty(qkv.shape[0], num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        if qkv.shape[0]:
            has_norm = q_norm is not None
            _qkv_rope_store_kernel[(qkv.shape[0],)](
                qkv,
                q,
                q_norm if has_norm else qkv,
                k_norm if has_norm else qkv,
                cos_sin,
                positions,
                slot_mapping,
                k_cache,
                v_cache,
                qkv.stride(0),
                eps,
                H=num_heads,
                KVH=num_kv_heads,
                D=head_dim,
                BLOCK_H=_pow2(num_heads),
                BLOCK_KV=_pow2(num_kv_heads),
                HAS_NORM=has_norm,
                **self._pdl,
            )
        return q

    def rope_attention(
        self,
        qkv,
        q_norm,
        k_norm,
        eps,
        positions,
        cos_sin,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale,
        num_heads,
        num_kv_heads,
        head_dim,
        feeds: Weight | None = None,
    ):
        """qkv_rope_store then attention: [T, H, D], or with feeds (the o projection's weight) [T, H * D] as that
        projection takes it: Fp8Rows with a scale per token and kv group or head (heads_per_scale) where the skinny
        fp8 GEMM follows a decode step of more than HEAD_SCALES_ABOVE_ROWS rows over an fp8-e5m2 cache. Split
        decode steps, and decode steps over an fp8-e5m2 cache whose rows each have a table row, do both in the
        attention kernel."""
        split = self._split_kv(meta)
        own_tables = meta.block_tables.shape[0] == qkv.shape[0]
        e5m2 = not split and own_tables and self._reads_e5m2_pairs(qkv, k_cache, meta, head_dim)
        rope = (q_norm, k_norm, cos_sin, positions, eps)
        rows = qkv.shape[0]
        heads_fp8 = e5m2 and feeds is not None and rows > HEAD_SCALES_ABOVE_ROWS
        if heads_fp8 and self._takes_grouped_fp8_rows(qkv[:, : num_heads * head_dim], feeds):
            heads_a_scale = heads_per_scale(num_heads // num_kv_heads)
            out = _empty_fp8_rows(rows, num_heads * head_dim, qkv, heads_a_scale * head_dim)
            if rows:
                self._decode_e5m2(
                    qkv,
                    k_cache,
                    v_cache,
                    meta,
                    scale,
                    out.data.view(rows, num_heads, head_dim),
                    rope=rope,
                    out_scale=out.scale,
                    scale_heads=heads_a_scale,
                )
            return out
        if split or e5m2:
            out = torch.empty(rows, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
            if rows:
                (self._split_decode if split else self._decode_e5m2)(qkv, k_cache, v_cache, meta, scale, out, rope=rope)
        else:
            q = self.qkv_rope_store(
                qkv,
                q_norm,
                k_norm,
                eps,
                positions,
                cos_sin,
                k_cache,
                v_cache,
                meta.slot_mapping,
                num_heads,
                num_kv_heads,
                head_dim,
            )
            out = self.attention(q, k_cache, v_cache, meta, scale)
        return out if feeds is None else out.flatten(1)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale):
        """Paged attention; context_lens may list k times as many sequences as block_tables has rows, each k
        consecutive ones sharing a table row: a speculative verify step's query rows attending as decode rows."""
        q = q.contiguous()
        out = torch.empty_like(q)
        n_seqs = meta.context_lens.shape[0]
        _, heads, dim = q.shape
        block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = heads // kv_heads
        if n_seqs == 0:
            return out
        if self._split_kv(meta):
            return self._split_decode(q.view(n_seqs, -1), k_cache, v_cache, meta, scale, out)
        if self._reads_e5m2_pairs(q, k_cache, meta, dim):
            return self._decode_e5m2(q, k_cache, v_cache, meta, scale, out)
        block_q = max(1, 16 // group) if meta.max_query_len > 1 else 1
        block_m = max(16, _pow2(block_q * group))
        grid = (n_seqs, kv_heads, triton.cdiv(meta.max_query_len, block_q))
        decode = meta.max_query_len == 1 and not self.batch_invariant
        block_n, warps, stages = paged_config(dim, k_cache.dtype == torch.float8_e5m2, decode)
        _paged_attention_kernel[grid](
            q,
            k_cache,
            v_cache,
            out,
            meta.block_tables,
            meta.query_start,
            meta.context_lens,
            scale,
            meta.block_tables.shape[1],
            n_seqs // max(meta.block_tables.shape[0], 1),
            H=heads,
            KVH=kv_heads,
            D=dim,
            BLOCK_SIZE=block_size,
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=warps,
            num_stages=stages,
            **self._pdl,
        )
        return out

    @staticmethod
    def _reads_e5m2_pairs(q, k_cache, meta: AttentionMetadata, dim: int) -> bool:
        """Decode steps over an fp8-e5m2 cache with 16-bit activations take _decode_e5m2_kernel (head_dim a power
        of two, >= 32); fp32 ones keep fp32 dots in the paged kernel."""
        return (
            meta.max_query_len == 1
            and k_cache.dtype == torch.float8_e5m2
            and dim >= 32
            and _pow2(dim) == dim
            and q.dtype in (torch.bfloat16, torch.float16)
        )

    def _decode_e5m2(
        self, q, k_cache, v_cache, meta: AttentionMetadata, scale, out, rope=None, out_scale=None, scale_heads=1
    ):
        """q: [rows, H, D] queries, or with rope=(q_norm, k_norm, cos_sin, positions, eps) the merged qkv rows.
        out_scale [rows, H / scale_heads]: out is fp8-e4m3, a scale per row and scale_heads heads (1 or H / KVH)."""
        n_seqs, heads, dim = out.shape
        block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        block_n, warps, stages = e5m2_decode_config(dim)
        q_norm, k_norm, cos_sin, positions, eps = rope or (None, None, q, meta.context_lens, 0.0)
        _decode_e5m2_kernel[(n_seqs, kv_heads)](
            q,
            k_cache,
            v_cache,
            k_cache.view(torch.int16),
            v_cache.view(torch.int16),
            out,
            meta.block_tables,
            meta.query_start,
            meta.context_lens,
            scale,
            meta.block_tables.shape[1],
            n_seqs // max(meta.block_tables.shape[0], 1),
            q.stride(0),
            q_norm if q_norm is not None else q,
            k_norm if k_norm is not None else q,
            cos_sin,
            positions,
            meta.slot_mapping,
            eps,
            out_scale if out_scale is not None else out,
            H=heads,
            KVH=kv_heads,
            D=dim,
            BLOCK_SIZE=block_size,
            BLOCK_M=max(16, _pow2(heads // kv_heads)),
            BLOCK_N=block_n,
            ROPE=rope is not None,
            HAS_NORM=q_norm is not None,
            FMAX=0.0 if out_scale is None else FP8_MAX["fp8-e4m3"],
            num_warps=warps,
            num_stages=stages,
            SCALE_HEADS=scale_heads,
            **self._pdl,
        )
        return out

    def _split_kv(self, meta: AttentionMetadata) -> bool:
        """Decode-only steps the runner captured with KV splits take the split-KV kernel."""
        return meta.max_query_len == 1 and self.decode_splits > 1

    def _split_decode(self, q, k_cache, v_cache, meta, scale, out, rope=None):
        """q: [rows, H * D] queries, or with rope=(q_norm, k_norm, cos_sin, positions, eps) the merged qkv rows."""
        n_rows, heads, dim = out.shape
        kv_heads, splits = k_cache.shape[2], self.decode_splits
        part = torch.empty(n_rows * heads * splits, dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(n_rows * heads * splits, 2, dtype=torch.float32, device=q.device)
        q_norm, k_norm, cos_sin, positions, eps = rope or (None, None, part, meta.context_lens, 0.0)
        has_norm = q_norm is not None
        per_table = n_rows // max(meta.block_tables.shape[0], 1)
        block_m = max(16, _pow2(heads // kv_heads))
        # Verify rows share programs, as many as decode's query tile holds; a decode row has its own.
        block_q = min(per_table, max(1, block_m // (heads // kv_heads)))
        programs = (n_rows // per_table) * triton.cdiv(per_table, block_q)
        _decode_split_kernel[(programs, kv_heads, splits)](
            q,
            k_cache,
            v_cache,
            part,
            ml,
            meta.block_tables,
            meta.context_lens,
            scale,
            meta.block_tables.shape[1],
            per_table,
            q.stride(0),
            q_norm if has_norm else q,
            k_norm if has_norm else q,
            cos_sin,
            positions,
            meta.slot_mapping,
            eps,
            H=heads,
            KVH=kv_heads,
            D=dim,
            BLOCK_SIZE=k_cache.shape[1],
            BLOCK_M=block_m,
            BLOCK_N=SPLIT_BLOCK_N,
            SPLITS=splits,
            BLOCK_Q=block_q,
            NEW_ROWS=_pow2(per_table),
            ROPE=rope is not None,
            HAS_NORM=has_norm,
            **self._pdl,
        )
        _decode_reduce_kernel[(n_rows * heads,)](part, ml, out, D=dim, SPLITS=splits, **self._pdl)
        return out

    # --- MLP / projections ----------------------------------------------------------------------------------
    def silu_and_mul(self, x):
        rows, n = x.shape[0], x.shape[1] // 2
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        if rows:
            block = min(1024, _pow2(n))
            _silu_mul_kernel[(rows, triton.cdiv(n, block))](x.contiguous(), out, n, BLOCK=block, **self._pdl)
        return out

    def _gemv_route(self, x, w) -> bool:
        """Whether x @ w.T goes through the register GEMV. Wide 16-bit outputs (the vocabulary projection) do not:
        cuBLAS streams them well, or the skinny GEMM where the graph wants row-invariance; quantized ones only we
        can read."""
        wide_ok = w.shape[0] <= GEMV_MAX_N or not isinstance(w, torch.Tensor)
        return self.register_gemv and self._gemv_fits(x, w) and wide_ok

    def linear(self, x, w: Weight, bias=None, live=None):
        """x @ w.T (+ bias); x may be Fp8Rows when _takes_fp8_rows(x, w) said so, Int8Rows when _takes_int8_rows
        did. live: see gemv."""
        if isinstance(x, Fp8Rows):
            out = self.skinny_gemm(x, w) if self._skinny_fits(x, w) else self._fp8_linear(x, w)
        elif isinstance(x, Int8Rows):  # 16-bit x for such a weight: the skinny GEMM below rounds it itself
            out = self.skinny_gemm(x, w)
        elif self._gemv_route(x, w):
            out = self.gemv(x, w, live=live)
        elif self._skinny_fits(x, w):
            out = self.skinny_gemm(x, w)
        elif isinstance(w, Int4Weight):
            # Larger batches: one dequantization pass, then the 16-bit path (the skinny GEMM up to 64 rows, else
            # cuBLAS).
            out = self.linear(x, self.int4_dequantize(w, x.dtype))
        elif isinstance(w, Fp8Weight) and w.fmt == "fp8-e4m3":
            out = self._fp8_linear(x, w)
        else:
            return super().linear(x, w, bias)
        return out if bias is None else out + bias.to(out.dtype)

    def _skinny_fits(self, x, w, keys_only: bool = False) -> bool:
        """fp8 weights at decode batch sizes (cuBLASLt's fp8 kernels are tuned for large M), and 16-bit ones
        unless skinny_dense is off; in row-invariant graphs any row count and wide outputs too (and wide outputs
        of which only greedy_keys' argmax is wanted: keys_only). Int4 weights up to
        INT4_SKINNY_MAX_ROWS rows (in row-invariant graphs any count, as a pass and a 16-bit GEMM sum in another
        order) where a K step of whole groups divides K or they meet Int8Rows (_meets_int8_rows), and large ones
        widened as the first operand up to 64 rows (_wide_int4)."""
        if isinstance(w, Int4Weight):
            return (
                (x.shape[0] <= INT4_SKINNY_MAX_ROWS or self.row_invariant or self._wide_int4(x, w))
                and x.dtype in (torch.bfloat16, torch.float16)
                and (_meets_int8_rows(w) or int4_skinny_config(x.shape[1], x.shape[0], w.group_size) is not None)
            )
        dense = self.skinny_dense and isinstance(w, torch.Tensor) and w.dtype == x.dtype
        # Wide 16-bit outputs (a vocabulary projection) stream better through cuBLAS, unless only their argmax is
        # wanted (keys_only: greedy_keys); wide fp8 ones do not through torch._scaled_mm (H200, Qwen3's head at 64
        # rows, norm included: bf16 cuBLAS 86.6 us, the skinny GEMM 100.2; fp8 torch._scaled_mm 60.1, the skinny
        # GEMM 54.9).
        wide_ok = isinstance(w, Fp8Weight) or keys_only
        small = x.shape[0] <= SKINNY_MAX_ROWS and (w.shape[0] <= GEMV_MAX_N or wide_ok)
        return (
            (small or self.row_invariant)
            and x.shape[1] % 16 == 0
            and x.dtype in (torch.bfloat16, torch.float16)
            and (dense or isinstance(w, Fp8Weight) and w.per_channel and w.fmt == "fp8-e4m3")
        )

    def skinny_gemm(self, x, w: Weight, config=None, keys: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T for up to SKINNY_MAX_ROWS rows (any number in row-invariant graphs); fp8 W meets per-token fp8 x,
        int4 W that _meets_int8_rows Int8Rows (made here if x is not), a 16-bit or other int4 W (widened tile by
        tile) x as is. keys: see greedy_keys (then returned instead of the outputs, which are not written)."""
        rows, k = x.shape
        n = w.shape[0]
        out = torch.empty((rows, n) if keys is None else (1, 1), dtype=x.dtype, device=x.device)  # (1, 1): its dtype
        kind, data, scales, offsets, group = self._weight_kind(w)
        wide = kind == INT4 and not isinstance(x, Int8Rows) and self._wide_int4(x, w)
        if kind == INT4 and _meets_int8_rows(w) and not isinstance(x, Int8Rows) and not wide:
            x = self.int8_quantize_rows(x, group)
        int8 = isinstance(x, Int8Rows)
        if kind == FP8:
            x_in, x_scale = self._fp8_rows(x)
        elif int8:
            x_in, x_scale = x.data, x.scale
        else:
            x_in, x_scale = x.contiguous(), x
        x_group = x.group if isinstance(x, Fp8Rows) else 0  # a power of two, as block_k
        # Row-invariant graphs: one tile shape (16 rows, the mma's) and configuration whatever the row count, so
        # each row's products are summed in a one-row call's order.
        tile_rows = 16 if self.row_invariant else rows
        if config is None:
            config = (
                int4_int8_config(n, k, tile_rows, group)
                if int8
                else int4_wide_config(n, k, tile_rows, group)
                if wide
                else int4_skinny_config(k, tile_rows, group)
                if kind == INT4
                else skinny_config(n, k, tile_rows, data.element_size())
            )
        block_n, block_k, stages, split_k = config
        if k % (split_k * block_k):
            split_k = 1
        block_m = skinny_block_m(tile_rows, kind)
        grid = (triton.cdiv(n, block_n), triton.cdiv(rows, block_m), split_k)
        parts, counts = (
            (out, out) if split_k == 1 else self._split_k_buffers(split_k * rows * n, grid[0] * grid[1], x.device)
        )
        _skinny_gemm_kernel[grid](
            x_in,
            x_scale,
            data,
            scales,
            offsets,
            out,
            out if keys is None else keys,
            parts,
            counts,
            rows,
            n,
            k,
            WKIND=kind,
            GROUP=group,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            SPLIT_K=split_k,
            num_warps=4,
            num_stages=stages,
            PREFETCH_LINES=self._prefetch_lines(kind, k // split_k),
            LINE=128 // data.element_size(),
            KEY_CHUNKS=0 if keys is None else keys.shape[1],
            X_GROUP=x_group,
            INT8_X=int8,
            x_sum_ptr=x.sums if int8 else x_in,
            W_AS_A=wide,
            **self._skinny_pdl(wide, rows),
        )
        return out if keys is None else keys

    def _skinny_pdl(self, wide: bool, rows: int) -> dict:
        """The skinny GEMM's launch options: the wide route up to INT4_WIDE_SERIAL_ROWS rows without programmatic
        dependent launch, everything else as the other kernels."""
        return {"PDL": False, "launch_pdl": False} if wide and rows <= INT4_WIDE_SERIAL_ROWS else self._pdl

    def _prefetch_lines(self, kind: int, k_slice: int) -> int:
        """128-byte lines of each weight row the skinny GEMM asks L2 for before its wait: fp8 weights only (an
        H200 call at 64 rows: 4.2-5.4 -> 3.8-4.8 us; a bf16 batch-64 step ran 3% slower with it)."""
        if not self._pdl["PDL"] or kind != FP8:
            return 0
        return _pow2(k_slice // 128)

    def _split_k_buffers(self, part_elems: int, tiles: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The split-K partials and per-tile arrival counts, shared by every call (kernels on one stream run one
        after another; a call leaves its counts at 0). Grown when a call needs more; outgrown buffers are kept,
        since graphs captured earlier still point at them."""
        buffers = self._split_k.setdefault(device, [])
        if not buffers or buffers[-1][0].numel() < part_elems or buffers[-1][1].numel() < tiles:
            buffers.append(
                (
                    torch.empty(max(part_elems, 1 << 20), dtype=torch.float32, device=device),
                    torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device),
                )
            )
        return buffers[-1]

    def int4_dequantize(self, w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
        n, k = w.shape
        out = torch.empty(n, k, dtype=dtype, device=w.packed.device)
        # Four rows of up to 1,024 columns, eight warps: the smallest sum over Qwen3's four projections in a sweep
        # of 24 configs on an H200 (13.1 us a layer against 24.5 for the one-row kernel before it).
        block_k = max(min(1024, _pow2(k)), w.group_size)
        _int4_dequant_kernel[(triton.cdiv(n, 4), triton.cdiv(k, block_k))](
            w.packed,
            w.scales,
            w.offsets,
            out,
            n,
            k,
            GROUP=w.group_size,
            BLOCK_R=4,
            BLOCK_K=block_k,
            num_warps=8,
            **self._pdl,
        )
        return out

    def _fp8_linear(self, x, w: Fp8Weight):
        """Prefill-sized fp8: per-token fp8 activations through the fp8 tensor cores (torch._scaled_mm)."""
        if not self._scaled_mm_fits(w):  # such weights run as W8A16
            return F.linear(x, w.dequantize(x.dtype))
        xq, x_scale = self._fp8_rows(x)
        w_scale = w.scale.reshape(1, -1) if w.per_channel else w.scale.reshape(1, 1).expand(1, w.shape[0])
        return torch._scaled_mm(
            xq, w.data.t(), scale_a=x_scale, scale_b=w_scale.float().contiguous(), out_dtype=x.dtype
        )

    def _takes_fp8_rows(self, x, w) -> bool:
        """Whether linear(x, w) starts by quantizing x per token to fp8-e4m3 (the skinny fp8 GEMM, or
        torch._scaled_mm for more rows): then x's producer can write it so (Fp8Rows) and save that pass."""
        fp8_e4m3 = isinstance(w, Fp8Weight) and w.fmt == "fp8-e4m3"
        if not fp8_e4m3 or x.dtype not in (torch.bfloat16, torch.float16) or self._gemv_route(x, w):
            return False
        return self._skinny_fits(x, w) or self._scaled_mm_fits(w)

    def _takes_grouped_fp8_rows(self, x, w) -> bool:
        """Whether linear(x, w) can take x as Fp8Rows with a scale per token and group of columns: the skinny
        fp8 GEMM only (torch._scaled_mm scales whole rows)."""
        return self._takes_fp8_rows(x, w) and self._skinny_fits(x, w)

    def _takes_int8_rows(self, x, w) -> bool:
        """Whether linear(x, w) takes x as Int8Rows (large int4 weights of 64+-column groups, in the skinny GEMM):
        then x's producer can write them, saving int8_quantize_rows' pass."""
        return (
            isinstance(w, Int4Weight)
            and _meets_int8_rows(w)
            and not self._gemv_route(x, w)
            and not self._wide_int4(x, w)
            and self._skinny_fits(x, w)
        )

    def _wide_int4(self, x, w) -> bool:
        """Whether linear(x, w) widens int4 w as the skinny GEMM's first operand (INT4_WIDE_ROWS). Not in
        row-invariant graphs, whose rows keep the route of every bucket size."""
        rows = x.shape[0]
        if (
            not isinstance(w, Int4Weight)
            or self.row_invariant
            or x.dtype not in (torch.bfloat16, torch.float16)
            or not INT4_WIDE_ROWS[0] <= rows <= INT4_WIDE_ROWS[1]
            or w.shape[0] < INT4_WIDE_MIN_N
            or not _large_weight(*w.shape)
            or int4_wide_config(*w.shape, rows, w.group_size) is None
        ):
            return False
        n, k = w.shape
        return rows > INT4_SKINNY_MAX_ROWS or not (n >= 4 * k and _meets_int8_rows(w))

    @staticmethod
    def _scaled_mm_fits(w: Fp8Weight) -> bool:
        """torch._scaled_mm's tile constraint."""
        return w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0

    def _fp8_rows(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        return (x.data, x.scale) if isinstance(x, Fp8Rows) else self.fp8_quantize_rows(x)

    def fp8_quantize_rows(self, x, fmt: str = "fp8-e4m3"):
        """Per-token fp8 activations and their float32 scales [rows, 1] (one Triton pass)."""
        rows, k = x.shape
        q = torch.empty(rows, k, dtype=torch.float8_e4m3fn if fmt == "fp8-e4m3" else torch.float8_e5m2, device=x.device)
        scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
        if rows:
            _fp8_quant_rows_kernel[(rows,)](
                x.contiguous(), q, scale, k, FMAX=FP8_MAX[fmt], BLOCK_K=_pow2(k), **self._pdl
            )
        return q, scale

    def norm_linear(
        self, x, residual, norm_w, eps, w: Weight, silu: bool = False, feeds: Weight | None = None, live=None
    ):
        """rmsnorm(x + residual) -> linear (-> silu-and-mul when w is merged gate/up): (out, new residual).

        residual None means x is the residual stream itself (the first layer). Batches of up to gemv_max_rows
        rows run as one fused GEMV (any weight kind); anything else as the separate kernels, the norm (and with
        feeds, the weight the silu output goes to, the SiLU) writing fp8 rows or Int8Rows when the projection
        after it takes them. live: see gemv (the separate kernels compute every row).
        """
        if self._gemv_route(x, w):
            pack = (None, None) if silu and self._packs(x, w, feeds, silu=True) else None
            if isinstance(x, PackedX):  # its producer added the residual and applied norm_w
                return self.gemv(x, w, eps=eps, silu=silu, live=live, pack=pack), residual
            return self.gemv(
                x, w, residual=residual, norm_w=norm_w, eps=eps, silu=silu, with_residual=True, live=live, pack=pack
            )
        normed, residual = self._norm_for(x, residual, norm_w, eps, w)
        out = self.linear(normed, w)
        if silu:
            act = out[:, : out.shape[1] // 2]  # the shape and dtype silu_and_mul's output will have
            if feeds is not None and self._takes_fp8_rows(act, feeds):
                out = self.silu_and_mul_fp8(out, grouped=self._takes_grouped_fp8_rows(act, feeds))
            elif feeds is not None and self._takes_int8_rows(act, feeds):
                out = self.silu_and_mul_int8(out, feeds.group_size)
            else:
                out = self.silu_and_mul(out)
        return out, residual

    def linear_into(self, x, w: Weight, residual, norm_w, feeds: Weight | None, live=None):
        """x @ w.T on its way to the projection by feeds, through an rmsnorm by norm_w (None: none) of it +
        residual: (that projection's PackedX, the new residual) where both are register GEMVs and feeds is int4 —
        the add, the norm weight and the rounding then happen here, once — else (x @ w.T, residual) for
        norm_linear to finish."""
        if residual is not None and self._packs(x, w, feeds):
            return self.gemv(x, w, live=live, pack=(residual, norm_w))
        return self.linear(x, w, live=live), residual

    def _packs(self, x, w: Weight, feeds: Weight | None, silu: bool = False) -> bool:
        """Whether the register GEMV x @ w.T (SiLU-and-mul of it with silu) can write its output as the PackedX of
        the register GEMV by feeds: an int4 weight of rows of at least PACKED_X_MIN_K columns in groups of whole
        blocks, and programs of w holding whole blocks."""
        if not (self.packed_x and isinstance(feeds, Int4Weight) and self._gemv_route(x, w)):
            return False
        n_out = w.shape[0] // 2 if silu else w.shape[0]
        block_n = gemv_config(w.shape[0], x.shape[1], self._weight_kind(w)[0])[0]
        nxt = torch.empty(x.shape[0], n_out, dtype=x.dtype, device="meta")
        whole = PACKED_BLOCK.value
        return (
            feeds.shape[1] == n_out >= PACKED_X_MIN_K
            and block_n % whole == 0
            and n_out % whole == 0
            and feeds.group_size % whole == 0
            and self._gemv_route(nxt, feeds)
        )

    def _norm_for(self, x, residual, norm_w, eps, w: Weight) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        """rmsnorm(x + residual) as the projection by w takes it (Fp8Rows or Int8Rows where it can), and the new
        residual."""
        if self._takes_fp8_rows(x, w):
            return self.add_rmsnorm_fp8(x, residual, norm_w, eps)
        if self._takes_int8_rows(x, w):
            return self.add_rmsnorm_int8(x, residual, norm_w, eps, w.group_size)
        if residual is None:
            return self.rmsnorm(x, norm_w, eps), x
        return self.add_rmsnorm(x, residual, norm_w, eps)

    @staticmethod
    def _weight_kind(w) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(kind, data, scales, offsets, group size) as the GEMV kernels take them."""
        if isinstance(w, Int4Weight):
            return INT4, w.packed, w.scales, w.offsets, w.group_size
        if isinstance(w, Fp8Weight):
            return FP8, w.data, w.scale.reshape(-1), w.scale, 1
        return DENSE, w, w, w, 1

    def _gemv_fits(self, x, w) -> bool:
        """Few rows (gemv_max_rows), rows of at most GEMV_MAX_K columns (LONG_GEMV_MAX_K for calls of at most
        large_gemv_rows rows of int4 weights, long_gemv_rows of 16-bit and fp8 ones), and for large 16-bit, fp8 or
        Int8Rows-meeting int4 weights at most large_gemv_rows rows."""
        rows, k = x.shape
        if rows > self.gemv_max_rows:
            return False
        if isinstance(w, Int4Weight):
            if rows > self.large_gemv_rows and _meets_int8_rows(w):
                return False
            long_ok = k <= GEMV_MAX_K or (k <= LONG_GEMV_MAX_K and rows <= self.large_gemv_rows)
            return long_ok and _pow2(k) % w.group_size == 0 and w.group_size % X_BLOCK.value == 0
        if k > GEMV_MAX_K and (k > LONG_GEMV_MAX_K or rows > self.long_gemv_rows):
            return False
        if rows > self.large_gemv_rows and _large_weight(w.shape[0], k):
            return False
        if isinstance(w, Fp8Weight):
            return w.per_channel
        return w.dtype == x.dtype

    def gemv(
        self,
        x,
        w,
        residual=None,
        norm_w=None,
        eps=0.0,
        silu=False,
        with_residual=False,
        config=None,
        live=None,
        pack=None,
    ):
        """Few-row x @ w.T as one Triton pass over w, optionally with the add+rmsnorm prologue / silu epilogue.
        live: [rows] ints, 0 where a row's result is not needed: where rows have programs of their own (small
        weights), those rows are skipped and their output and residual rows left as they are. x may be a PackedX
        (int4 w; its norm, if any, is done but for 1 / rms, which takes eps). pack (residual or None, next norm
        weight or None): write the output as the next int4 GEMV's PackedX (see linear_into); returned with the new
        residual when pack has one."""
        rows, k = x.shape
        n_out = w.shape[0] // 2 if silu else w.shape[0]
        kind, data, scales, offsets, group = self._weight_kind(w)
        block_n, warps = config or gemv_config(n_out * (2 if silu else 1), k, kind)
        packed_in = isinstance(x, PackedX)
        x_in = x.data if packed_in else x
        q_res, q_norm = pack or (None, None)
        parts = triton.cdiv(n_out, block_n) if q_norm is not None else 0
        out = (
            torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
            if pack is None
            else _empty_packed_x(rows, n_out, parts, x.dtype, x.device)
        )
        has_res = residual is not None
        res_out = torch.empty_like(x) if has_res else x_in
        if q_res is not None:  # the output's residual; nothing comes in with x then
            assert not has_res
            residual, res_out = q_res, torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
        elif pack is not None and not has_res:  # the kernel reads the output dtype from res_out
            res_out = torch.empty(0, dtype=x.dtype, device=x.device)
        assert norm_w is None or q_norm is None
        row_block = gemv_row_block(rows, w.shape[0], k)
        # Only rows with programs of their own can be skipped: in shared programs the check cost a Qwen3 bf16
        # batch-1 decode step 17 us and saved nothing.
        live = live if row_block == 1 and rows > 1 else None
        block_k, block_kb = gemv_k_pieces(w.shape[0], k, group)
        _norm_gemv_kernel[(triton.cdiv(n_out, block_n), triton.cdiv(rows, row_block))](
            x_in,
            residual if residual is not None else x_in,
            res_out,
            norm_w if norm_w is not None else q_norm if q_norm is not None else x_in,
            data,
            scales,
            offsets,
            out.data if pack is not None else out,
            x_in if live is None else live,
            rows,
            k,
            n_out,
            eps,
            x.parts if packed_in else 0,
            HAS_NORM=norm_w is not None or packed_in and x.parts > 0,
            HAS_RES=has_res,
            SILU=silu,
            WKIND=kind,
            GROUP=group,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            BLOCK_KB=block_kb,
            ROW_BLOCK=row_block,
            LIVE=live is not None,
            PACKED=packed_in,
            P_BLOCK=_parts_block(x.parts) if packed_in else 1,
            QOUT=pack is not None,
            QRES=q_res is not None,
            QNORM=q_norm is not None,
            Q_PBLOCK=_parts_block(parts),
            num_warps=warps,
            **self._pdl,
        )
        if q_res is not None:
            return out, res_out
        return (out, res_out) if with_residual else out

    def decode_inputs(self, positions, live, tables, block_size):
        """Slot and context length of each row's next token, from its position and block table (-1 / 0 if idle)."""
        rows = positions.shape[0]
        slots = torch.empty(rows, dtype=torch.int64, device=positions.device)
        ctx = torch.empty(rows, dtype=torch.int32, device=positions.device)
        _decode_inputs_kernel[(1,)](
            positions,
            live,
            tables,
            slots,
            ctx,
            rows,
            tables.stride(0),
            BLOCK_SIZE=block_size,
            BLOCK=_pow2(rows),
            **self._pdl,
        )
        return slots, ctx

    def argmax_keys(self, logits: torch.Tensor, chunks: int | None = None, out: torch.Tensor | None = None):
        """[rows, chunks] packed (logit, index) maxima of chunks of each row (into out, if given); decode_advance
        finishes the argmax."""
        rows, n = logits.shape
        chunks = out.shape[1] if out is not None else chunks or argmax_chunks(n)
        keys = out if out is not None else torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
        chunk = triton.cdiv(n, chunks)
        if rows:
            _argmax_chunks_kernel[(rows, chunks)](
                logits, keys, n, chunk, CHUNKS=chunks, BLOCK=_pow2(chunk), **self._pdl
            )
        return keys

    def greedy_keys(self, x, residual, norm_w, eps, w: Weight, keys: torch.Tensor) -> torch.Tensor:
        """argmax_keys of norm_linear(x, residual, norm_w, eps, w)'s outputs, into keys [rows, argmax_chunks(vocab)]
        holding zeros (as decode_advance leaves them). Where that projection can be the skinny GEMM (past the
        GEMV's rows: 16-bit heads as well as fp8 ones), its programs' row maxima go straight into keys and the
        [rows, vocab] logits are never written. H200, Qwen3's head with its norm and decode_advance, us at 8 / 16 /
        32 / 64 rows: bf16 89.9 / 95.7 / 103.6 / 121.0 through cuBLAS and an argmax pass, 78.6 / 79.8 / 84.1 /
        92.9 here; fp8 at 64 rows 83.8 -> 67.5."""
        if self._gemv_route(x, w) or not self._skinny_fits(x, w, keys_only=True):
            return self.argmax_keys(self.norm_linear(x, residual, norm_w, eps, w)[0], out=keys)
        return self.skinny_gemm(self._norm_for(x, residual, norm_w, eps, w)[0], w, keys=keys)

    def decode_advance(self, tokens, ids, positions, out_tokens, step_index):
        """tokens: [rows] sampled tokens, or argmax_keys' [rows, chunks] keys of a greedy step."""
        rows = tokens.shape[0]
        _decode_advance_kernel[(1,)](
            tokens,
            ids,
            positions,
            out_tokens,
            step_index,
            rows,
            out_tokens.stride(0),
            BLOCK=_pow2(rows),
            CHUNKS=_key_chunks(tokens),
            **self._pdl,
        )
