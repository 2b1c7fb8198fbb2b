"""CPU kernels: the reference, with the hot ops routed to PyTorch's fused CPU paths."""

import contextlib

import torch
import torch.nn.functional as F

from flashnext.core.kernels import AttentionMetadata, ReferenceKernels, SamplingTensors
from flashnext.core.precision import Fp8Weight, Int4Weight

# On the torch path quantized weights are expanded to fp16 once, on first use: batch-1 decode streams every weight
# from memory and fp16 halves fp32's bytes, and torch's int4 CPU matmul is slower than both (docs/benchmarks.md).
EXPANDED_DTYPE = torch.float16
PREFILL_ROWS = 8
# fp32 GEMMs pick their blocking by row count, so a row's sums change with M; run at a fixed M they do not.
INVARIANT_TILE_ROWS = 16


class CpuKernels(ReferenceKernels):
    """batch_invariant: each row's result is the same whatever other rows share the call. Linear layers take one path
    for any row count (torch's own fp16 CPU GEMM reduces each row alone; fp32 GEMMs run in fixed tiles of rows) and
    every prompt position attends as a decode step would (one query over its own context), so chunking a prompt
    differently changes nothing either."""

    def __init__(self, batch_invariant: bool = False):
        self.batch_invariant = batch_invariant
        # Keyed by id() but holding the weight too, so a freed weight's id can never alias a cached tensor.
        self._expanded: dict[int, tuple[object, torch.Tensor, bool]] = {}
        self._rope_key: tuple[object, object] | None = None
        self._rope_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def rmsnorm(self, x, weight, eps):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rmsnorm(self, x, residual, weight, eps):
        residual = x + residual
        return F.rms_norm(residual, (x.shape[-1],), weight, eps), residual

    def rope(self, q, k, positions, cos_sin):
        # Every layer of a step rotates by the same positions: gather the table rows once per step.
        if self._rope_key is None or self._rope_key[0] is not positions or self._rope_key[1] is not cos_sin:
            self._rope_key = (positions, cos_sin)
            self._rope_cos_sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        cos, sin = self._rope_cos_sin
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        if bool((slot_mapping < 0).any()):  # padded rows: the reference masks them out
            return super().store_kv(k, v, k_cache, v_cache, slot_mapping)
        for new, cache in ((k, k_cache), (v, v_cache)):
            new = new.to(cache.dtype)
            if cache.dtype.itemsize == 1:  # index_copy_ has no float8 kernel: move the bytes
                new, cache = new.view(torch.uint8), cache.view(torch.uint8)
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, new)

    def linear(self, x, w, bias=None):
        if isinstance(w, (Int4Weight, Fp8Weight)):
            dense, bounded = self._dense(w)
        else:  # a dense weight in another dtype than x: an fp16 LM head is trusted, anything else widened
            dense, bounded = w, w.dtype == EXPANDED_DTYPE
        if dense.dtype == x.dtype:
            return self._gemm(x, dense, bias)
        if not bounded or (x.shape[0] >= PREFILL_ROWS and not self.batch_invariant):
            # Compute-bound (many rows) or a weight whose fp16 product could overflow: widen it for this call.
            return self._gemm(x, dense.to(x.dtype), None if bias is None else bias.to(x.dtype))
        # fp16 holds only ±65504: each row runs scaled to unit max, so large activations neither overflow nor lose
        # bits, and `bounded` guarantees the products of unit rows stay inside the range.
        row_scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        with self._row_independent():
            out = F.linear((x / row_scale).to(dense.dtype), dense).to(x.dtype) * row_scale
        return out if bias is None else out + bias.to(x.dtype)

    def _gemm(self, x, w, bias):
        if not self.batch_invariant:
            return F.linear(x, w, bias)
        if x.dtype != torch.float32:
            with self._row_independent():
                return F.linear(x, w, bias)
        rows = x.shape[0]
        padded = torch.cat((x, x.new_zeros(-rows % INVARIANT_TILE_ROWS, x.shape[1])))
        tiles = [F.linear(tile, w, bias) for tile in padded.split(INVARIANT_TILE_ROWS)]
        return torch.cat(tiles)[:rows]

    def _row_independent(self):
        """Where batch_invariant: half-precision GEMMs through torch's own CPU kernel, which reduces each row alone.
        oneDNN's, which torch picks on CPUs with fp16 or AMX instructions, blocks rows by their count."""
        if not self.batch_invariant:
            return contextlib.nullcontext()
        return torch.backends.mkldnn.flags(enabled=False, deterministic=None, allow_tf32=None, fp32_precision=None)

    def _dense(self, w) -> tuple[torch.Tensor, bool]:
        entry = self._expanded.get(id(w))
        if entry is None or entry[0] is not w:
            dense = w.dequantize(torch.float32)
            bounded = _bounded(dense)
            entry = self._expanded[id(w)] = (w, dense.to(EXPANDED_DTYPE) if bounded else dense, bounded)
        return entry[1], entry[2]

    def sample(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        # numpy's argmax over a vocabulary row takes ~3 us where torch's CPU argmax takes ~60 (both pick the first
        # largest, a NaN before any number): a decode step's whole greedy sampling.
        if params.all_greedy and logits.dtype == torch.float32:
            return torch.from_numpy(logits.numpy().argmax(-1))
        return super().sample(logits, params)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        block_size = k_cache.shape[1]
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
            blocks = meta.block_tables[i, : -(-ctx_len // block_size)]
            keys = k_cache[blocks].flatten(0, 1)[:ctx_len].transpose(0, 1)
            values = v_cache[blocks].flatten(0, 1)[:ctx_len].transpose(0, 1)
            query = q[start : start + q_len].transpose(0, 1)
            if q_len == 1 or not self.batch_invariant:
                out[start : start + q_len] = _attend(query, keys, values, scale).transpose(0, 1)
            else:  # each position as its decode step: one query over the context up to itself
                first = ctx_len - q_len
                for j in range(q_len):
                    ctx = first + j + 1
                    out[start + j] = _attend(query[:, j : j + 1], keys[:, :ctx], values[:, :ctx], scale)[:, 0]
            start += q_len
        return out


def _attend(query, keys, values, scale):
    """[H, Q, D] queries, the last Q positions of a context of [KV, C, D] keys and values: causal SDPA."""
    q_len, ctx_len = query.shape[1], keys.shape[1]
    mask = None
    if q_len > 1:  # queries are the last q_len positions of the context: causal, offset to the end
        mask = torch.ones(q_len, ctx_len, dtype=torch.bool).tril(ctx_len - q_len)
    # A leading batch dim routes SDPA to its flash CPU kernel; 3-D inputs take the math path, which
    # materializes [heads, q, ctx] scores (gigabytes for a long prompt; the flash kernel works in tiles).
    attended = F.scaled_dot_product_attention(
        query[None],
        keys.to(query.dtype)[None],
        values.to(query.dtype)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return attended[0]


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _bounded(w: torch.Tensor) -> bool:
    """Whether a row of unit max times this weight stays within fp16 (|out| <= K * max|w|)."""
    return bool(w.shape[-1] * w.abs().max() < torch.finfo(EXPANDED_DTYPE).max)
