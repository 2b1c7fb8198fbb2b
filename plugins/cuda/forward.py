"""The decoder forward pass on the fused CUDA kernels: seven launches a layer in the batch-1 decode case.

Same weights and numerics as DecoderModel.forward (core/model.py), rearranged so that each rmsnorm rides in the
prologue of the projection after it, q/k norm + rope + the KV-cache write are one pass, and SiLU-and-mul rides in
the gate/up epilogue (qkv GEMV, rope+KV, split-KV attention + its reduction, o GEMV, gate/up GEMV, down GEMV).
Larger batches fall back, op by op, to the unfused Triton kernels and cuBLAS.
"""

import torch

from flashnext.core.kernels import AttentionMetadata
from flashnext.core.model import DecoderModel

from .kernels import CudaKernels


def forward(model: DecoderModel, kernels: CudaKernels, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata, kv_caches) -> torch.Tensor:
    """Hidden states after the final norm, [T, hidden]."""
    cfg, eps = model.config, model.config.rms_norm_eps
    hidden = kernels.embedding(input_ids, model.embed)
    residual = None
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
        qkv, residual = kernels.norm_linear(hidden, residual, layer.input_norm, eps, layer.qkv)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        q = kernels.qkv_rope_store(qkv, layer.q_norm, layer.k_norm, eps, positions, model.cos_sin, k_cache, v_cache,
                                   meta.slot_mapping, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        attn = kernels.attention(q, k_cache, v_cache, meta, model.scale)
        out = kernels.linear(attn.flatten(1), layer.o)
        act, residual = kernels.norm_linear(out, residual, layer.post_norm, eps, layer.gate_up, silu=True)
        hidden = kernels.linear(act, layer.down)
    return kernels.add_rmsnorm(hidden, residual, model.norm, eps)[0]
