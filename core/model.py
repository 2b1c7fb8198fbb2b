"""One decoder for the Llama / Qwen2 / Qwen3 dense family, written against the Kernels interface."""

import math
from dataclasses import dataclass

import torch

from . import model_cache
from .config import ModelConfig, RopeScaling
from .errors import UserError
from .kernels import AttentionMetadata, ReferenceKernels
from .precision import Precision, Weight, concat_rows, validate_weight


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Weight  # q, k and v projections merged at load time: one GEMM instead of three
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Weight
    post_norm: torch.Tensor
    gate_up: Weight  # gate and up merged likewise
    down: Weight


class DecoderModel:
    """Holds converted weights on the device and runs forward passes over flat token batches."""

    # A TensorParallel (core/parallel.py) when the weights are one rank's shards: the engine sets it. The o and
    # down projections' partial sums are then all-reduced, and the embedding and logits are vocabulary slices.
    parallel = None

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, Weight],
        kernels: ReferenceKernels,
        precision: Precision,
        device: torch.device,
        activation_dtype: torch.dtype,
        head_dtype: torch.dtype | None = None,
        quantized_head: bool = False,
    ):
        self.config, self.kernels, self.precision = config, kernels, precision
        self.device, self.dtype = device, activation_dtype
        take = _WeightTaker(weights, device, activation_dtype, precision)
        self.embed = take.dense("model.embed_tokens.weight")
        self.layers = [self._layer(take, f"model.layers.{i}.") for i in range(config.num_layers)]
        self.norm = take.dense("model.norm.weight")
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        head_dtype = head_dtype or activation_dtype
        # A tied head shares the embedding table unless the backend stores it otherwise.
        if quantized_head:
            self.lm_head = take.linear([head_name], precision.head)
        else:
            self.lm_head = self.embed if tied and head_dtype == activation_dtype else take.dense(head_name, head_dtype)
        self.cos_sin = rope_cache(config, device)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5

    def _layer(self, take: "_WeightTaker", prefix: str) -> LayerWeights:
        attn, mlp, cfg = prefix + "self_attn.", prefix + "mlp.", self.config
        return LayerWeights(
            input_norm=take.dense(prefix + "input_layernorm.weight"),
            qkv=take.linear([attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"]),
            qkv_bias=take.bias([attn + f"{p}_proj.bias" for p in "qkv"]) if cfg.qkv_bias else None,
            q_norm=take.dense(attn + "q_norm.weight") if cfg.qk_norm else None,
            k_norm=take.dense(attn + "k_norm.weight") if cfg.qk_norm else None,
            o=take.linear([attn + "o_proj.weight"]),
            post_norm=take.dense(prefix + "post_attention_layernorm.weight"),
            gate_up=take.linear([mlp + "gate_proj.weight", mlp + "up_proj.weight"]),
            down=take.linear([mlp + "down_proj.weight"]),
        )

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden], for every token of the step."""
        k, eps = self.kernels, self.config.rms_norm_eps
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            if residual is None:
                x, residual = k.rmsnorm(hidden, layer.input_norm, eps), hidden
            else:
                x, residual = k.add_rmsnorm(hidden, residual, layer.input_norm, eps)
            attn = self._attention(layer, x, positions, meta, k_cache, v_cache)
            x, residual = k.add_rmsnorm(attn, residual, layer.post_norm, eps)
            hidden = self.reduced(k.linear(k.silu_and_mul(k.linear(x, layer.gate_up)), layer.down))
        return k.add_rmsnorm(hidden, residual, self.norm, eps)[0]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel is None:
            return self.kernels.embedding(input_ids, self.embed)
        return self.parallel.embedding(self.kernels, input_ids, self.embed)

    def reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output: its ranks' partial sums added (itself on one rank)."""
        return partial if self.parallel is None else self.parallel.all_reduce(partial)

    def _attention(self, layer: LayerWeights, x, positions, meta, k_cache, v_cache):
        k, cfg = self.kernels, self.config
        qkv = k.linear(x, layer.qkv, layer.qkv_bias)
        q, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        key = key.view(-1, cfg.num_kv_heads, cfg.head_dim)
        value = value.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = k.rmsnorm(q, layer.q_norm, cfg.rms_norm_eps)
            key = k.rmsnorm(key, layer.k_norm, cfg.rms_norm_eps)
        q, key = k.rope(q, key, positions, self.cos_sin)
        k.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        out = k.attention(q, k_cache, v_cache, meta, self.scale)
        return self.reduced(k.linear(out.flatten(1), layer.o))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] float32; tensor-parallel, the slices gathered on rank 0 (None on the others)."""
        logits = self.kernels.linear(hidden, self.lm_head).float()
        return logits if self.parallel is None else self.parallel.gather_logits(logits)


class _WeightTaker:
    """Moves checkpoint tensors to the device: norms and embeddings dense, projections in the target precision.
    What it read of a converted-model entry's file map (the checks read every value) leaves memory again."""

    def __init__(self, weights, device, dtype, precision: Precision):
        self.weights, self.device, self.dtype, self.precision = weights, device, dtype, precision

    def _get(self, name: str) -> Weight:
        if name not in self.weights:
            raise UserError(f"checkpoint lacks tensor '{name}': the file is incomplete or not a supported model")
        return self.weights[name]

    def dense(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        w = self._get(name)
        w = w if isinstance(w, torch.Tensor) else w.dequantize(torch.float32)
        validate_weight(name, w)
        model_cache.drop_pages(w)
        return w.to(device=self.device, dtype=dtype or self.dtype)

    def bias(self, names: list[str]) -> torch.Tensor:
        return torch.cat([self.dense(n) for n in names])

    def linear(self, names: list[str], precision: Precision | None = None) -> Weight:
        # Converted where they will live: an accelerator rounds a projection to int4 or fp8 far faster than the host
        # (the parts' originals are transient there, one projection at a time).
        precision = precision or self.precision
        parts = [precision.quantize(self._get(n).to(self.device)) for n in names]
        merged = concat_rows(parts) if len(parts) > 1 else parts[0]
        validate_weight(names[0], merged)
        model_cache.drop_pages(*(t for n in names for t in tensors_of(self._get(n))))
        if isinstance(merged, torch.Tensor):
            return merged.to(device=self.device, dtype=precision.storage_dtype)
        return merged.to(self.device)


def tensors_of(w: Weight) -> tuple[torch.Tensor, ...]:
    """The tensors a weight keeps its values in."""
    if isinstance(w, torch.Tensor):
        return (w,)
    return tuple(v for v in vars(w).values() if isinstance(v, torch.Tensor))


def weight_bytes(
    config: ModelConfig, weights: dict[str, Weight], precision: Precision, dense_dtype: torch.dtype
) -> int:
    """At least the device bytes of the weights DecoderModel keeps: projections in `precision`, the rest (norms,
    embeddings, an LM head) in dense_dtype."""
    total = 0
    for name, w in weights.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if layer is not None and int(layer) >= config.num_layers:
            continue  # an MTP module's layers: its drafter loads them apart
        if name.endswith("_proj.weight"):
            total += precision.stored_bytes(*w.shape)
        else:
            total += math.prod(w.shape) * dense_dtype.itemsize
    return total


def prefill_token_bytes(config: ModelConfig, dense_dtype: torch.dtype, kv_itemsize: int) -> int:
    """What one prompt token of a prefill chunk takes beside the weights, estimated: its KV cache entries and one
    layer's activations (the residual stream, q/k/v, attention output and the MLP's gate, up and product)."""
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * kv_itemsize
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    return kv + (3 * config.hidden_size + qkv + 3 * config.intermediate_size) * dense_dtype.itemsize


ROPE_MAX_VALUES = 1 << 27  # 512 MiB of float32: a 1M-token context at head_dim 128
_ROPE_CHUNK = 1 << 16


def rope_cache(config: ModelConfig, device) -> torch.Tensor:
    """[max_pos, head_dim] table: cos in the first half, sin in the second. Angles are computed in float64 a chunk
    of positions at a time, so building the table takes little more memory than the table."""
    positions, dim = config.max_position_embeddings, config.head_dim
    if positions * dim > ROPE_MAX_VALUES:
        raise UserError(
            f"the model's context length {positions} needs a rope table of "
            f"{positions * dim * 4 / 2**30:.1f} GiB; pass --max-model-len (at most "
            f"{ROPE_MAX_VALUES // dim}) to run it with a shorter context"
        )
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    inv_freq = _scale_frequencies(inv_freq, config.rope_scaling)
    table = torch.empty(positions, dim, dtype=torch.float32)
    for start in range(0, positions, _ROPE_CHUNK):
        angles = torch.outer(torch.arange(start, min(start + _ROPE_CHUNK, positions), dtype=torch.float64), inv_freq)
        table[start : start + len(angles)] = torch.cat((angles.cos(), angles.sin()), dim=-1)
    return table.to(device)


def _scale_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling | None) -> torch.Tensor:
    if scaling is None or scaling.type == "default":
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, blended)
    return torch.where(wavelen < high_wavelen, inv_freq, scaled)
