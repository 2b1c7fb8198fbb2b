"""Triton kernels for the CUDA backend; each matches ReferenceKernels (tests run them under TRITON_INTERPRET=1).

Activations are bf16/fp16 rows; every kernel rounds where the reference rounds, so the two agree to bf16 noise.
Besides the Kernels interface this adds the fused ops the CUDA forward (forward.py) uses: q/k-norm + rope + KV
write in one pass, rmsnorm fused into a small-batch GEMV prologue, and SiLU-and-mul fused into its epilogue.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flashnext.core.kernels import AttentionMetadata, ReferenceKernels
from flashnext.core.precision import FP8_MAX, Fp8Weight, Int4Weight, Weight

# Rows up to this many go through the fused norm-GEMV (one weight read per row): the batch-1 decode path.
GEMV_MAX_ROWS = 2
# Hidden sizes whose whole row fits one program's registers for the fused norm prologue.
GEMV_MAX_K = 4096
# Int4 weights at most this many rows of activations use the fused dequant GEMM; bigger batches dequantize once.
INT4_FUSED_MAX_ROWS = 64


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# ---------------------------------------------------------------------------------------------------------------
# Norms


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, K, eps,
                    HAS_RES: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    x = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0)
    if HAS_RES:
        # The reference adds in the activation dtype, then normalizes the rounded sum.
        x = (x.to(tl.float32) + tl.load(res_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * K + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * K + cols, (xf * rms * w).to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# q/k norm + rope + KV-cache write


@triton.jit
def _rope_heads(src, pos_cs, w_ptr, eps, heads, D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                HAS_NORM: tl.constexpr, dtype: tl.constexpr):
    """Loads [heads, D] at src, optionally rmsnorms each head, rotates (neox); returns the two halves."""
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, HALF)[None, :]
    m = h < heads
    x1 = tl.load(src + h * D + j, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + h * D + HALF + j, mask=m, other=0.0).to(tl.float32)
    if HAS_NORM:
        rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
        x1 = (x1 * rms * tl.load(w_ptr + j).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (x2 * rms * tl.load(w_ptr + HALF + j).to(tl.float32)).to(dtype).to(tl.float32)
    cos = tl.load(pos_cs + j)
    sin = tl.load(pos_cs + HALF + j)
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype), h, j, m


@triton.jit
def _qkv_rope_store_kernel(qkv_ptr, q_out_ptr, qn_ptr, kn_ptr, cos_sin_ptr, pos_ptr, slot_ptr, k_cache, v_cache,
                           stride_qkv, eps, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, HAS_NORM: tl.constexpr):
    t = tl.program_id(0)
    HALF: tl.constexpr = D // 2
    dtype = q_out_ptr.dtype.element_ty
    pos_cs = cos_sin_ptr + tl.load(pos_ptr + t) * D
    row = qkv_ptr + t * stride_qkv
    q1, q2, h, j, m = _rope_heads(row, pos_cs, qn_ptr, eps, H, D, HALF, BLOCK_H, HAS_NORM, dtype)
    tl.store(q_out_ptr + t * H * D + h * D + j, q1, mask=m)
    tl.store(q_out_ptr + t * H * D + h * D + HALF + j, q2, mask=m)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        k1, k2, kh, kj, km = _rope_heads(row + H * D, pos_cs, kn_ptr, eps, KVH, D, HALF, BLOCK_KV, HAS_NORM, dtype)
        cdt = k_cache.dtype.element_ty
        dst = slot * KVH * D + kh * D + kj
        tl.store(k_cache + dst, k1.to(cdt), mask=km)
        tl.store(k_cache + dst + HALF, k2.to(cdt), mask=km)
        v_src = row + (H + KVH) * D + kh * D + kj
        tl.store(v_cache + dst, tl.load(v_src, mask=km).to(cdt), mask=km)
        tl.store(v_cache + dst + HALF, tl.load(v_src + HALF, mask=km).to(cdt), mask=km)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, slot_ptr, stride_k, stride_v, WIDTH: tl.constexpr,
                     BLOCK: tl.constexpr):
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
def _attention_tile(q, k_cache, v_cache, tables_ptr, seq, kvh, q_pos, lo, hi, scale,
                    KVH: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, max_blocks):
    """Online softmax of q [BLOCK_M, D] over cached keys lo..hi; returns (acc, running max, running sum)."""
    d = tl.arange(0, D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        block = tl.load(tables_ptr + seq * max_blocks + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        offs = (block * BLOCK_SIZE + n % BLOCK_SIZE) * KVH * D + kvh * D
        k = tl.load(k_cache + offs[:, None] + d[None, :], mask=n_ok[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(n_ok[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(v_cache + offs[:, None] + d[None, :], mask=n_ok[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_attention_kernel(q_ptr, k_cache, v_cache, out_ptr, tables_ptr, qstart_ptr, ctx_ptr, scale, max_blocks,
                            H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (sequence, kv head, query tile); a tile's rows are (query token, head of the kv group) pairs."""
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
        q = tl.load(q_ptr + q_offs, mask=ok[:, None], other=0.0)
        q_pos = ctx - q_len + t
        hi = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_Q)  # causal: later keys are invisible to this tile
        acc, m_i, l_i = _attention_tile(q, k_cache, v_cache, tables_ptr, seq, kvh, q_pos, 0, hi, scale,
                                        KVH, D, BLOCK_SIZE, BLOCK_M, BLOCK_N, max_blocks)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_offs, out.to(out_ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _decode_split_kernel(q_ptr, k_cache, v_cache, part_ptr, ml_ptr, tables_ptr, ctx_ptr, scale, max_blocks,
                         H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """Decode only (one query per sequence): split s of SPLITS covers one slice of the context."""
    seq, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    GROUP: tl.constexpr = H // KVH
    ctx = tl.load(ctx_ptr + seq)
    chunk = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(ctx, lo + chunk)
    r = tl.arange(0, BLOCK_M)
    head = kvh * GROUP + r % GROUP
    ok = r < GROUP
    d = tl.arange(0, D)
    q = tl.load(q_ptr + seq * H * D + head[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    q_pos = tl.zeros([BLOCK_M], tl.int32) + ctx - 1
    acc, m_i, l_i = _attention_tile(q, k_cache, v_cache, tables_ptr, seq, kvh, q_pos, lo, hi, scale,
                                    KVH, D, BLOCK_SIZE, BLOCK_M, BLOCK_N, max_blocks)
    base = (seq * H + head) * SPLITS + split
    tl.store(part_ptr + base[:, None] * D + d[None, :], acc, mask=ok[:, None])
    tl.store(ml_ptr + base * 2, m_i, mask=ok)
    tl.store(ml_ptr + base * 2 + 1, l_i, mask=ok)


@triton.jit
def _decode_reduce_kernel(part_ptr, ml_ptr, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)  # seq * H + head
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    m = tl.load(ml_ptr + (row * SPLITS + s) * 2)
    l = tl.load(ml_ptr + (row * SPLITS + s) * 2 + 1)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max)))
    acc = tl.sum(tl.load(part_ptr + (row * SPLITS + s)[:, None] * D + d[None, :]) * w[:, None], axis=0)
    total = tl.sum(l * w, axis=0)
    tl.store(out_ptr + row * D + d, (acc / tl.where(total == 0.0, 1.0, total)).to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------------------------
# Elementwise


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    gate = tl.load(x_ptr + row * 2 * N + cols, mask=m, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * N + N + cols, mask=m, other=0.0)
    # F.silu rounds to the activation dtype before the product, as the reference does.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(out_ptr + row * N + cols, (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype), mask=m)


@triton.jit
def _fp8_quant_rows_kernel(x_ptr, q_ptr, scale_ptr, K, FMAX: tl.constexpr, BLOCK_K: tl.constexpr):
    """Dynamic per-token activation scale: amax of the row's finite values lands on the format maximum."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    m = cols < K
    x = tl.load(x_ptr + row * K + cols, mask=m, other=0.0).to(tl.float32)
    finite = tl.abs(x) < float("inf")
    amax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=0)
    scale = tl.maximum(amax / FMAX, 1.1754943508222875e-38 * 1.1920928955078125e-07)
    scale = tl.where(amax > 0, scale, 1.0)
    q = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(scale_ptr + row, scale)


# ---------------------------------------------------------------------------------------------------------------
# GEMV / GEMM


@triton.jit
def _norm_gemv_kernel(x_ptr, res_ptr, res_out_ptr, nw_ptr, w_ptr, out_ptr, K, N_OUT, eps,
                      HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, SILU: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[row] = W · rmsnorm(x[row] (+ res[row])), the whole row in registers; SILU folds silu(gate) * up in.

    With SILU the weight is gate rows then up rows ([2 * N_OUT, K]) and out is [rows, N_OUT]. Program 0 writes the
    new residual; the others only read the old one, so the output buffer must differ from the input.
    """
    pid, row = tl.program_id(0), tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    k = tl.arange(0, BLOCK_K)
    k_ok = k < K
    x = tl.load(x_ptr + row * K + k, mask=k_ok, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * K + k, mask=k_ok, other=0.0).to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * K + k, x, mask=k_ok & (pid == 0))
    xf = x.to(tl.float32)
    if HAS_NORM:
        rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
        xf = (xf * rms * tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N_OUT
    w_mask = n_ok[:, None] & k_ok[None, :]
    w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=w_mask, other=0.0)
    acc = tl.sum(w.to(tl.float32) * xf[None, :], axis=1).to(dtype)
    if SILU:
        u = tl.load(w_ptr + (n + N_OUT)[:, None] * K + k[None, :], mask=w_mask, other=0.0)
        up = tl.sum(u.to(tl.float32) * xf[None, :], axis=1).to(dtype)
        gate = acc.to(tl.float32)
        acc = ((gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * N_OUT + n, acc, mask=n_ok)


@triton.jit
def _int4_matmul_kernel(x_ptr, packed_ptr, scales_ptr, offsets_ptr, out_ptr, M, N, K,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out = x · dequant(W)ᵀ, one quantization group per K step; even/odd input columns meet low/high nibbles."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    HALF: tl.constexpr = GROUP // 2
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    i = tl.arange(0, HALF)
    groups = K // GROUP
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(0, groups):
        p = tl.load(packed_ptr + rn[:, None] * (K // 2) + g * HALF + i[None, :], mask=n_ok[:, None], other=0)
        s = tl.load(scales_ptr + rn * groups + g, mask=n_ok, other=0.0)[:, None]
        o = tl.load(offsets_ptr + rn * groups + g, mask=n_ok, other=0.0)[:, None]
        w_lo = ((p & 0xF).to(tl.float32) * s + o).to(x_ptr.dtype.element_ty)
        w_hi = ((p >> 4).to(tl.float32) * s + o).to(x_ptr.dtype.element_ty)
        cols = g * GROUP + 2 * i
        x_even = tl.load(x_ptr + rm[:, None] * K + cols[None, :], mask=m_ok[:, None], other=0.0)
        x_odd = tl.load(x_ptr + rm[:, None] * K + cols[None, :] + 1, mask=m_ok[:, None], other=0.0)
        acc += tl.dot(x_even, tl.trans(w_lo))
        acc += tl.dot(x_odd, tl.trans(w_hi))
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------------------------------


class CudaKernels(ReferenceKernels):
    """Triton versions of the hot ops; sampling and embedding stay in PyTorch (already one or two launches)."""

    def __init__(self, decode_splits: int = 1):
        # KV splits for decode attention; the runner sets this per captured batch size (small batches need more
        # programs than sequences x kv heads to fill the GPU).
        self.decode_splits = decode_splits

    # --- norms ---------------------------------------------------------------------------------------------
    def rmsnorm(self, x, weight, eps):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty_like(x2)
        if x2.shape[0]:
            _rmsnorm_kernel[(x2.shape[0],)](x2, x2, x2, weight, out, x2.shape[1], eps, HAS_RES=False,
                                            BLOCK_K=_pow2(x2.shape[1]))
        return out.view(x.shape)

    def add_rmsnorm(self, x, residual, weight, eps):
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        if x.shape[0]:
            _rmsnorm_kernel[(x.shape[0],)](x, residual, res_out, weight, out, x.shape[1], eps, HAS_RES=True,
                                           BLOCK_K=_pow2(x.shape[1]))
        return out, res_out

    # --- attention block pieces ----------------------------------------------------------------------------
    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        k2, v2 = k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
        if k2.shape[0]:
            width = k2.shape[1]
            _store_kv_kernel[(k2.shape[0],)](k2, v2, k_cache, v_cache, slot_mapping, k2.stride(0), v2.stride(0),
                                             WIDTH=width, BLOCK=_pow2(width))

    def qkv_rope_store(self, qkv, q_norm, k_norm, eps, positions, cos_sin, k_cache, v_cache, slot_mapping,
                       num_heads, num_kv_heads, head_dim) -> torch.Tensor:
        """Merged qkv rows [T, (H + 2 KV) D] -> rotated q [T, H, D]; rotated k and v go straight into the cache."""
        q = torch.empty(qkv.shape[0], num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        if qkv.shape[0]:
            has_norm = q_norm is not None
            _qkv_rope_store_kernel[(qkv.shape[0],)](
                qkv, q, q_norm if has_norm else qkv, k_norm if has_norm else qkv, cos_sin, positions, slot_mapping,
                k_cache, v_cache, qkv.stride(0), eps, H=num_heads, KVH=num_kv_heads, D=head_dim,
                BLOCK_H=_pow2(num_heads), BLOCK_KV=_pow2(num_kv_heads), HAS_NORM=has_norm)
        return q

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale):
        q = q.contiguous()
        out = torch.empty_like(q)
        n_seqs = meta.context_lens.shape[0]
        _, heads, dim = q.shape
        block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = heads // kv_heads
        if n_seqs == 0:
            return out
        if meta.max_query_len == 1 and self.decode_splits > 1:
            return self._split_decode(q, k_cache, v_cache, meta, scale, out)
        block_q = max(1, 16 // group) if meta.max_query_len > 1 else 1
        block_m = max(16, _pow2(block_q * group))
        grid = (n_seqs, kv_heads, triton.cdiv(meta.max_query_len, block_q))
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out, meta.block_tables, meta.query_start, meta.context_lens, scale,
            meta.block_tables.shape[1], H=heads, KVH=kv_heads, D=dim, BLOCK_SIZE=block_size, BLOCK_Q=block_q,
            BLOCK_M=block_m, BLOCK_N=64 if dim <= 128 else 32)
        return out

    def _split_decode(self, q, k_cache, v_cache, meta, scale, out):
        n_seqs, heads, dim = q.shape
        kv_heads, splits = k_cache.shape[2], self.decode_splits
        part = torch.empty(n_seqs * heads * splits, dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(n_seqs * heads * splits, 2, dtype=torch.float32, device=q.device)
        _decode_split_kernel[(n_seqs, kv_heads, splits)](
            q, k_cache, v_cache, part, ml, meta.block_tables, meta.context_lens, scale, meta.block_tables.shape[1],
            H=heads, KVH=kv_heads, D=dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_M=max(16, _pow2(heads // kv_heads)),
            BLOCK_N=32, SPLITS=splits)
        _decode_reduce_kernel[(n_seqs * heads,)](part, ml, out, D=dim, SPLITS=splits)
        return out

    # --- MLP / projections ----------------------------------------------------------------------------------
    def silu_and_mul(self, x):
        rows, n = x.shape[0], x.shape[1] // 2
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        if rows:
            block = min(1024, _pow2(n))
            _silu_mul_kernel[(rows, triton.cdiv(n, block))](x.contiguous(), out, n, BLOCK=block)
        return out

    def linear(self, x, w: Weight, bias=None):
        if isinstance(w, Int4Weight):
            out = self._int4_linear(x, w)
        elif isinstance(w, Fp8Weight) and w.fmt == "fp8-e4m3":
            out = self._fp8_linear(x, w)
        else:
            return super().linear(x, w, bias)
        return out if bias is None else out + bias.to(out.dtype)

    def _int4_linear(self, x, w: Int4Weight):
        rows, (n, k) = x.shape[0], w.shape
        if rows > INT4_FUSED_MAX_ROWS:
            return F.linear(x, w.dequantize(x.dtype))
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        block_n = 64 if rows > 16 else 32
        grid = (triton.cdiv(rows, 16), triton.cdiv(n, block_n))
        _int4_matmul_kernel[grid](x.contiguous(), w.packed, w.scales, w.offsets, out, rows, n, k,
                                  GROUP=w.group_size, BLOCK_M=16, BLOCK_N=block_n)
        return out

    def _fp8_linear(self, x, w: Fp8Weight):
        xq, x_scale = self.fp8_quantize_rows(x)
        w_scale = w.scale.reshape(1, -1) if w.per_channel else w.scale.reshape(1, 1).expand(1, w.shape[0])
        return torch._scaled_mm(xq, w.data.t(), scale_a=x_scale, scale_b=w_scale.float().contiguous(),
                                out_dtype=x.dtype)

    def fp8_quantize_rows(self, x, fmt: str = "fp8-e4m3"):
        """Per-token fp8 activations and their float32 scales [rows, 1] (one Triton pass)."""
        rows, k = x.shape
        q = torch.empty(rows, k, dtype=torch.float8_e4m3fn if fmt == "fp8-e4m3" else torch.float8_e5m2,
                        device=x.device)
        scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
        if rows:
            _fp8_quant_rows_kernel[(rows,)](x.contiguous(), q, scale, k, FMAX=FP8_MAX[fmt], BLOCK_K=_pow2(k))
        return q, scale

    def norm_linear(self, x, residual, norm_w, eps, w: Weight, silu: bool = False):
        """rmsnorm(x + residual) -> linear (-> silu-and-mul when w is merged gate/up): (out, new residual).

        residual None means x is the residual stream itself (the first layer). Small batches of dense weights
        run as one fused GEMV; anything else as the separate kernels.
        """
        rows, k = x.shape
        dense = isinstance(w, torch.Tensor) and w.dtype == x.dtype
        if not (dense and rows <= GEMV_MAX_ROWS and k <= GEMV_MAX_K):
            if residual is None:
                normed, residual = self.rmsnorm(x, norm_w, eps), x
            else:
                normed, residual = self.add_rmsnorm(x, residual, norm_w, eps)
            out = self.linear(normed, w)
            return (self.silu_and_mul(out) if silu else out), residual
        n_out = w.shape[0] // 2 if silu else w.shape[0]
        out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
        has_res = residual is not None
        res_out = torch.empty_like(x) if has_res else x
        block_n = 8 if k <= 2048 else 4
        _norm_gemv_kernel[(triton.cdiv(n_out, block_n), rows)](
            x, residual if has_res else x, res_out, norm_w, w, out, k, n_out, eps, HAS_NORM=True, HAS_RES=has_res,
            SILU=silu, BLOCK_N=block_n, BLOCK_K=_pow2(k), num_warps=4)
        return out, res_out
