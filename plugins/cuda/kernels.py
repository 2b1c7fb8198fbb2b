"""CudaKernels: the CUDA backend's Kernels, each op routed to a Triton kernel that matches ReferenceKernels (tests
run them under TRITON_INTERPRET=1). The kernels live in one module a family; launch.py says which a call takes.

Activations are bf16/fp16 rows; every kernel rounds where the reference rounds, so the two agree to bf16 noise.
Besides the Kernels interface this adds the fused ops the CUDA forward (forward.py) uses: q/k-norm + rope + KV
write in one pass, rmsnorm fused into a small-batch GEMV prologue, and SiLU-and-mul fused into its epilogue.
"""

import torch
import torch.nn.functional as F
import triton

from flashnext.core.kernels import AttentionMetadata, ReferenceKernels
from flashnext.core.precision import FP8_MAX, Fp8Weight, Int4Weight, Weight

from . import launch
from .attention import _paged_attention_kernel, _qkv_rope_store_kernel, _store_kv_kernel
from .decode_attention import _decode_e5m2_kernel, _decode_reduce_kernel, _decode_split_kernel
from .decode_step import _argmax_chunks_kernel, _decode_advance_kernel, _decode_inputs_kernel, _key_chunks
from .elementwise import _rmsnorm_kernel, _silu_mul_kernel
from .gemm import _skinny_gemm_kernel
from .gemv import PACKED_BLOCK, X_BLOCK, PackedX, _empty_packed_x, _norm_gemv_kernel, _parts_block
from .primitives import _pow2, pdl_supported
from .quant import (
    Fp8Rows,
    Int8Rows,
    _empty_fp8_rows,
    _empty_int8_rows,
    _fp8_quant_rows_kernel,
    _int4_dequant_kernel,
    _int8_quant_rows_kernel,
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
        # cuBLAS: it starts under programmatic dependent launch, which makes the steps shorter.
        self.skinny_dense = True
        # The runner raises this while it captures the graphs of a speculative run (decode and K + 1-row verify
        # steps): the GEMV computes each row exactly as a one-row call does, whatever the row count...
        self.gemv_max_rows = launch.GEMV_MAX_ROWS
        # ... and sets this: the vocabulary projection then goes through the skinny GEMM in 16-row tiles, which
        # computes each row as a one-row call does too, faster than the GEMV would (see skinny_gemm).
        self.row_invariant = False
        # Profile batch_invariant (set by the runner for eager steps and every graph): decode rows attend with the
        # prompt rows' tile configuration too, so a step's mix of rows changes no row's attention.
        self.batch_invariant = False
        # Row counts up to which large weights and long rows take the GEMV (see _gemv_fits); graph_settings sets
        # both for row-invariant graphs.
        self.large_gemv_rows = launch.LARGE_GEMV_MAX_ROWS
        self.long_gemv_rows = launch.LONG_GEMV_MAX_ROWS
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
        warps, the fastest), or grouped, a scale per token and 1,024 columns, the programs silu_and_mul runs."""
        rows, n = x.shape[0], x.shape[1] // 2
        block = launch.silu_fp8_group(n) if grouped else _pow2(n)
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
        heads_fp8 = e5m2 and feeds is not None and rows > launch.HEAD_SCALES_ABOVE_ROWS
        if heads_fp8 and self._takes_grouped_fp8_rows(qkv[:, : num_heads * head_dim], feeds):
            heads_a_scale = launch.heads_per_scale(num_heads // num_kv_heads)
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
        block_n, warps, stages = launch.paged_config(dim, k_cache.dtype == torch.float8_e5m2, decode)
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
        block_n, warps, stages = launch.e5m2_decode_config(dim)
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
            BLOCK_N=launch.SPLIT_BLOCK_N,
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
        wide_ok = w.shape[0] <= launch.GEMV_MAX_N or not isinstance(w, torch.Tensor)
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
        order) where a K step of whole groups divides K or they meet Int8Rows (meets_int8_rows), and large ones
        widened as the first operand up to 64 rows (_wide_int4)."""
        if isinstance(w, Int4Weight):
            return (
                (x.shape[0] <= launch.INT4_SKINNY_MAX_ROWS or self.row_invariant or self._wide_int4(x, w))
                and x.dtype in (torch.bfloat16, torch.float16)
                and (
                    launch.meets_int8_rows(w)
                    or launch.int4_skinny_config(x.shape[1], x.shape[0], w.group_size) is not None
                )
            )
        dense = self.skinny_dense and isinstance(w, torch.Tensor) and w.dtype == x.dtype
        # Wide 16-bit outputs (a vocabulary projection) stream better through cuBLAS, unless only their argmax is
        # wanted (keys_only: greedy_keys); wide fp8 ones do not through torch._scaled_mm.
        wide_ok = isinstance(w, Fp8Weight) or keys_only
        small = x.shape[0] <= launch.SKINNY_MAX_ROWS and (w.shape[0] <= launch.GEMV_MAX_N or wide_ok)
        return (
            (small or self.row_invariant)
            and x.shape[1] % 16 == 0
            and x.dtype in (torch.bfloat16, torch.float16)
            and (dense or isinstance(w, Fp8Weight) and w.per_channel and w.fmt == "fp8-e4m3")
        )

    def skinny_gemm(self, x, w: Weight, config=None, keys: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T for up to SKINNY_MAX_ROWS rows (any number in row-invariant graphs); fp8 W meets per-token fp8 x,
        int4 W that meets_int8_rows Int8Rows (made here if x is not), a 16-bit or other int4 W (widened tile by
        tile) x as is. keys: see greedy_keys (then returned instead of the outputs, which are not written)."""
        rows, k = x.shape
        n = w.shape[0]
        out = torch.empty((rows, n) if keys is None else (1, 1), dtype=x.dtype, device=x.device)  # (1, 1): its dtype
        kind, data, scales, offsets, group = self._weight_kind(w)
        wide = kind == launch.INT4 and not isinstance(x, Int8Rows) and self._wide_int4(x, w)
        if kind == launch.INT4 and launch.meets_int8_rows(w) and not isinstance(x, Int8Rows) and not wide:
            x = self.int8_quantize_rows(x, group)
        int8 = isinstance(x, Int8Rows)
        if kind == launch.FP8:
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
                launch.int4_int8_config(n, k, tile_rows, group)
                if int8
                else launch.int4_wide_config(n, k, tile_rows, group)
                if wide
                else launch.int4_skinny_config(k, tile_rows, group)
                if kind == launch.INT4
                else launch.skinny_config(n, k, tile_rows, data.element_size())
            )
        block_n, block_k, stages, split_k = config
        if k % (split_k * block_k):
            split_k = 1
        block_m = launch.skinny_block_m(tile_rows, kind)
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
        return {"PDL": False, "launch_pdl": False} if wide and rows <= launch.INT4_WIDE_SERIAL_ROWS else self._pdl

    def _prefetch_lines(self, kind: int, k_slice: int) -> int:
        """128-byte lines of each weight row the skinny GEMM asks L2 for before its wait: fp8 weights only (16-bit
        ones ran slower with it)."""
        if not self._pdl["PDL"] or kind != launch.FP8:
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
        # Four rows of up to 1,024 columns, eight warps: the fastest over a layer's four projections.
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
            and launch.meets_int8_rows(w)
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
            or not launch.INT4_WIDE_ROWS[0] <= rows <= launch.INT4_WIDE_ROWS[1]
            or w.shape[0] < launch.INT4_WIDE_MIN_N
            or not launch.is_large_weight(*w.shape)
            or launch.int4_wide_config(*w.shape, rows, w.group_size) is None
        ):
            return False
        n, k = w.shape
        return rows > launch.INT4_SKINNY_MAX_ROWS or not (n >= 4 * k and launch.meets_int8_rows(w))

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
        block_n = launch.gemv_config(w.shape[0], x.shape[1], self._weight_kind(w)[0])[0]
        nxt = torch.empty(x.shape[0], n_out, dtype=x.dtype, device="meta")
        whole = PACKED_BLOCK.value
        return (
            feeds.shape[1] == n_out >= launch.PACKED_X_MIN_K
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
            return launch.INT4, w.packed, w.scales, w.offsets, w.group_size
        if isinstance(w, Fp8Weight):
            return launch.FP8, w.data, w.scale.reshape(-1), w.scale, 1
        return launch.DENSE, w, w, w, 1

    def _gemv_fits(self, x, w) -> bool:
        """Few rows (gemv_max_rows), rows of at most GEMV_MAX_K columns (LONG_GEMV_MAX_K for calls of at most
        large_gemv_rows rows of int4 weights, long_gemv_rows of 16-bit and fp8 ones), and for large 16-bit, fp8 or
        Int8Rows-meeting int4 weights at most large_gemv_rows rows."""
        rows, k = x.shape
        if rows > self.gemv_max_rows:
            return False
        if isinstance(w, Int4Weight):
            if rows > self.large_gemv_rows and launch.meets_int8_rows(w):
                return False
            long_ok = k <= launch.GEMV_MAX_K or (k <= launch.LONG_GEMV_MAX_K and rows <= self.large_gemv_rows)
            return long_ok and _pow2(k) % w.group_size == 0 and w.group_size % X_BLOCK.value == 0
        if k > launch.GEMV_MAX_K and (k > launch.LONG_GEMV_MAX_K or rows > self.long_gemv_rows):
            return False
        if rows > self.large_gemv_rows and launch.is_large_weight(w.shape[0], k):
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
        block_n, warps = config or launch.gemv_config(n_out * (2 if silu else 1), k, kind)
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
        row_block = launch.gemv_row_block(rows, w.shape[0], k)
        # Only rows with programs of their own can be skipped: in shared programs the check costs and saves nothing.
        live = live if row_block == 1 and rows > 1 else None
        block_k, block_kb = launch.gemv_k_pieces(w.shape[0], k, group)
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
        chunks = out.shape[1] if out is not None else chunks or launch.argmax_chunks(n)
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
        [rows, vocab] logits are never written, shorter than cuBLAS and an argmax pass."""
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
