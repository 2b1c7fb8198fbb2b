"""CPU kernels: the reference, with the hot ops routed to PyTorch's fused CPU paths."""

import torch
import torch.nn.functional as F

from flashnext.core.kernels import AttentionMetadata, ReferenceKernels
from flashnext.core.precision import Fp8Weight, Int4Weight


class CpuKernels(ReferenceKernels):
    def __init__(self):
        # Quantized weights expanded once, on first use: on the CPU a dense fp32 GEMM beats any dequantize-per-call
        # path at these sizes, and the quantized form stays the source of truth (it is what was validated).
        # Keyed by id() but holding the weight too, so a freed weight's id can never alias a cached tensor.
        self._expanded: dict[int, tuple[object, torch.Tensor]] = {}

    def rmsnorm(self, x, weight, eps):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rmsnorm(self, x, residual, weight, eps):
        residual = x + residual
        return F.rms_norm(residual, (x.shape[-1],), weight, eps), residual

    def linear(self, x, w, bias=None):
        if isinstance(w, (Int4Weight, Fp8Weight)):
            w = self._dense(w, x.dtype)
        return F.linear(x, w, bias)

    def _dense(self, w, dtype) -> torch.Tensor:
        entry = self._expanded.get(id(w))
        if entry is None or entry[0] is not w:
            entry = self._expanded[id(w)] = (w, w.dequantize(dtype))
        return entry[1]

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        block_size = k_cache.shape[1]
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
            blocks = meta.block_tables[i, : -(-ctx_len // block_size)]
            keys = k_cache[blocks].flatten(0, 1)[:ctx_len].transpose(0, 1)
            values = v_cache[blocks].flatten(0, 1)[:ctx_len].transpose(0, 1)
            query = q[start : start + q_len].transpose(0, 1)
            mask = None
            if q_len > 1:  # queries are the last q_len positions of the context: causal, offset to the end
                mask = torch.ones(q_len, ctx_len, dtype=torch.bool).tril(ctx_len - q_len)
            # A leading batch dim routes SDPA to its flash CPU kernel; 3-D inputs take the math path, which
            # materializes [heads, q, ctx] scores (1.4 GiB for a 4k prompt instead of 76 MiB).
            attended = F.scaled_dot_product_attention(
                query[None], keys.to(q.dtype)[None], values.to(q.dtype)[None], attn_mask=mask, scale=scale,
                enable_gqa=True,
            )
            out[start : start + q_len] = attended[0].transpose(0, 1)
            start += q_len
        return out
