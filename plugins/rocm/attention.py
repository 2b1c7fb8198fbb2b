"""Attention on ROCm: ROCm flash attention (its Composable Kernel build, imported as flash_attn) for prefill where
it runs; the paged-attention Triton kernels shared with the CUDA plugin for decode and everywhere else."""

import functools
from dataclasses import dataclass

import torch

from flashnext.core.errors import UserError
from flashnext.core.kernels import AttentionMetadata

from .device import GfxTarget

FLASH_MAX_HEAD_DIM = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionChoice:
    prefill: str  # "flash_attn" or "triton"; decode is always the Triton paged kernel
    reason: str


@functools.cache
def load_flash_attn():
    """(flash_attn_varlen_func, None), or (None, why it cannot be used)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as exc:  # an ImportError, or a build for another ROCm / torch failing as it loads
        return None, f"flash_attn does not import ({exc.__class__.__name__}: {exc})"
    return flash_attn_varlen_func, None


def choose_attention(requested: str, gfx: str, target: GfxTarget, dtype: torch.dtype | None) -> AttentionChoice:
    """requested: auto, flash_attn or triton (Profile.attention). A flash_attn that cannot run here is refused
    when asked for by name; auto then falls back to Triton, saying why."""
    if requested == "triton":
        return AttentionChoice("triton", "asked for (attention: triton)")
    why_not = None
    if not target.flash_attn:
        why_not = f"flash_attn's Composable Kernel build does not support {gfx or 'this GPU'}"
    elif dtype is not None and dtype not in FLASH_DTYPES:
        why_not = f"flash_attn takes fp16 / bf16, not {str(dtype).removeprefix('torch.')} activations"
    else:
        why_not = load_flash_attn()[1]
    if why_not is None:
        by = "asked for" if requested == "flash_attn" else "auto"
        return AttentionChoice(
            "flash_attn",
            f"{by}: flash_attn varlen for prefill (head dim <= {FLASH_MAX_HEAD_DIM},"
            " else Triton), Triton paged attention for decode",
        )
    if requested == "flash_attn":
        raise UserError(
            f"attention 'flash_attn' cannot run here: {why_not}; use attention auto or triton (FLASHNEXT_ATTENTION)"
        )
    return AttentionChoice("triton", f"auto: {why_not}; Triton paged attention for prefill and decode")


def flash_fits(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Steps flash_attn takes: prompt-shaped (more than one query row), 16-bit, head dim <= 256, each sequence
    with its own block table row and host lengths (a verify step sharing table rows stays on Triton)."""
    n = len(meta.context_lens_host)
    return (
        meta.max_query_len > 1
        and q.dtype in FLASH_DTYPES
        and q.shape[-1] <= FLASH_MAX_HEAD_DIM
        and n > 0
        and meta.block_tables.shape[0] == n == meta.context_lens.shape[0]
    )


def context_slots(meta: AttentionMetadata, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache slot of each sequence's context tokens laid end to end ([sum of context lengths] int64) and their
    cumulative lengths (int32 [B + 1]), as flash_attn's varlen API counts keys."""
    lens = torch.tensor(meta.context_lens_host, dtype=torch.int64)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens).to(device)
    pos = (torch.arange(int(cu[-1])) - cu[:-1].long().repeat_interleave(lens)).to(device)
    slots = meta.block_tables[seq, pos // block_size].long() * block_size + pos % block_size
    return slots, cu.to(device)


class FlashAttnPrefill:
    """Mixed into the shared kernels' class: prompt-shaped steps through flash_attn_varlen_func, the rest (and
    every decode step) through the class it is mixed into."""

    flash_attn_varlen_func = None
    _slots_of: tuple[AttentionMetadata, torch.Tensor, torch.Tensor] | None = None  # the step's, for every layer

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale):
        if self.flash_attn_varlen_func is None or not flash_fits(q, meta):
            return super().attention(q, k_cache, v_cache, meta, scale)
        if self._slots_of is None or self._slots_of[0] is not meta:
            self._slots_of = (meta, *context_slots(meta, k_cache.shape[1], k_cache.device))
        _, slots, cu_seqlens_k = self._slots_of
        k = k_cache.flatten(0, 1)[slots].to(q.dtype)
        v = v_cache.flatten(0, 1)[slots].to(q.dtype)
        # causal=True masks bottom-right aligned: a chunk's queries are the last rows of their context.
        return self.flash_attn_varlen_func(
            q.contiguous(),
            k,
            v,
            meta.query_start,
            cu_seqlens_k,
            meta.max_query_len,
            meta.max_context_len,
            softmax_scale=scale,
            causal=True,
        )
