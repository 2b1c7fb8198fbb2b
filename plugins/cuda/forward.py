"""The decoder forward pass on the fused CUDA kernels: six launches a layer in a small-batch decode step (qkv GEMV,
split-KV attention with rope and the KV write + its reduction, o GEMV, gate/up GEMV, down GEMV).

Same weights and numerics as DecoderModel.forward (core/model.py), rearranged so that each rmsnorm rides in the
prologue of the projection after it (the final one too where the vocabulary projection is a GEMV: quantized
heads; otherwise it is the skinny GEMM or cuBLAS after a norm pass, see logits_of, and a greedy step's argmax
rides in that skinny GEMM, see greedy_keys_of), q/k norm + rope + the KV-cache write ride in the attention kernel
(or are one pass before it), and SiLU-and-mul rides in the gate/up epilogue. Where an int4 GEMV of long rows
(PACKED_X_MIN_K) follows a GEMV, the residual add, the next norm's weight and the rounding of x to int8 ride in
the producer's epilogue instead (CudaKernels.linear_into).
Larger batches fall back, op by op, to the unfused Triton kernels, the skinny GEMM (up to 64 rows) and cuBLAS.
"""

import torch

from flashnext.core.kernels import AttentionMetadata
from flashnext.core.model import DecoderModel

from .kernels import CudaKernels


def forward_unnormed(
    model: DecoderModel,
    kernels: CudaKernels,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    kv_caches,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer's output and the residual stream before it, [T, hidden] each: the final norm is left to
    the kernel after it (the vocabulary projection can take it in its prologue)."""
    cfg, eps = model.config, model.config.rms_norm_eps
    live = live_rows(meta)
    hidden = model.embed_tokens(input_ids)  # model.kernels is kernels; tensor-parallel: vocabulary slices
    residual = None
    for i, (layer, (k_cache, v_cache)) in enumerate(zip(model.layers, kv_caches)):
        qkv, residual = kernels.norm_linear(hidden, residual, layer.input_norm, eps, layer.qkv, live=live)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        attn = kernels.rope_attention(
            qkv,
            layer.q_norm,
            layer.k_norm,
            eps,
            positions,
            model.cos_sin,
            k_cache,
            v_cache,
            meta,
            model.scale,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            feeds=layer.o,
        )
        out, residual = _row_parallel(model, kernels, attn, layer.o, residual, layer.post_norm, layer.gate_up, live)
        act, residual = kernels.norm_linear(
            out, residual, layer.post_norm, eps, layer.gate_up, silu=True, feeds=layer.down, live=live
        )
        following = model.layers[i + 1] if i + 1 < len(model.layers) else None
        hidden, residual = _row_parallel(
            model,
            kernels,
            act,
            layer.down,
            residual,
            following and following.input_norm,
            following and following.qkv,
            live,
        )
    return hidden, residual


def _row_parallel(model: DecoderModel, kernels: CudaKernels, x, w, residual, norm_w, feeds, live):
    """kernels.linear_into; where the weights are one tensor-parallel rank's, the partial product is all-reduced
    first (an NCCL call the decode graphs capture), and the residual add and norm that linear_into may fuse into
    its epilogue wait for the sum: norm_linear does them after it."""
    if model.parallel is None:
        return kernels.linear_into(x, w, residual, norm_w, feeds, live=live)
    return model.reduced(kernels.linear(x, w, live=live)), residual


def forward(
    model: DecoderModel,
    kernels: CudaKernels,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    kv_caches,
) -> torch.Tensor:
    """Hidden states after the final norm, [T, hidden]."""
    hidden, residual = forward_unnormed(model, kernels, input_ids, positions, meta, kv_caches)
    return kernels.add_rmsnorm(hidden, residual, model.norm, model.config.rms_norm_eps)[0]


def logits_of(model: DecoderModel, kernels: CudaKernels, hidden: torch.Tensor, residual: torch.Tensor):
    """16-bit logits of forward_unnormed's output; the final norm rides in the projection's prologue where that is
    the register GEMV, else (16-bit heads) it is a pass of its own before the skinny GEMM or cuBLAS."""
    logits = kernels.norm_linear(hidden, residual, model.norm, model.config.rms_norm_eps, model.lm_head)[0]
    return logits if model.parallel is None else model.parallel.gather_vocab(logits)


def greedy_keys_of(
    model: DecoderModel, kernels: CudaKernels, hidden: torch.Tensor, residual: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """A greedy step's argmax keys (see CudaKernels.greedy_keys) of the logits logits_of would give; tensor-parallel,
    the tokens themselves, from each rank's best candidate (decode_advance takes either)."""
    if model.parallel is not None:
        local = kernels.norm_linear(hidden, residual, model.norm, model.config.rms_norm_eps, model.lm_head)[0]
        return model.parallel.greedy_tokens(local)
    return kernels.greedy_keys(hidden, residual, model.norm, model.config.rms_norm_eps, model.lm_head, keys)


def live_rows(meta: AttentionMetadata) -> torch.Tensor | None:
    """A decode-only step's context lengths, which are 0 exactly for the rows that compute nothing (a verify
    step's rows past its drafts, a bucket's padding): the projections skip those rows. None for other steps."""
    return meta.context_lens if meta.max_query_len == 1 else None
