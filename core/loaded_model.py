"""What a loader hands back, and the shape check every loader runs before it does."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from flashnext.core.config import ModelConfig
from flashnext.core.errors import UserError
from flashnext.core.precision import Weight
from flashnext.core.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, Weight]  # canonical HF names, on CPU
    tokenizer: Tokenizer
    source: str  # path shown to the user
    name: str  # short model name for JSON output


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape for every weight the model needs (plus lm_head when untied)."""
    h, hd, v, i = config.hidden_size, config.head_dim, config.vocab_size, config.intermediate_size
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if config.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def shown(value) -> str:
    """A value from a file as an error line shows it: repr, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_model(model: LoadedModel) -> None:
    """Everything the kernels assume of a model, checked at load so a bad file fails with its name, not later."""
    check_config(model.config, model.source)
    check_weights(model.config, model.weights, model.source)
    check_layer_count(model.config, model.weights, model.source)
    check_tokenizer_fits(model.config, model.tokenizer, model.source)


def sharded_model(config: ModelConfig, plan, weights: dict[str, Weight], tokenizer, source: str, name: str):
    """One tensor-parallel rank's LoadedModel: its shard checked against the whole model's config, carried with
    the config its DecoderModel runs (plan.local_config())."""
    from flashnext.core.sharding import check_shard

    check_config(config, source)
    check_shard(config, plan, weights, source)
    check_tokenizer_fits(config, tokenizer, source)
    return LoadedModel(plan.local_config(), weights, tokenizer, source, name)


def check_config(config: ModelConfig, source: str) -> None:
    if config.num_heads % config.num_kv_heads:
        raise UserError(
            f"{source}: {config.num_heads} attention heads do not divide into {config.num_kv_heads} KV "
            "heads (num_attention_heads % num_key_value_heads must be 0); fix the config"
        )
    if config.head_dim % 2:
        raise UserError(
            f"{source}: head_dim {config.head_dim} is odd; rotary embeddings need an even head_dim, fix the config"
        )
    if not math.isfinite(config.rope_theta):
        raise UserError(f"{source}: rope_theta = {config.rope_theta} is not finite; set the model's rope base")
    s = config.rope_scaling
    if s is not None:
        for field in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            value = getattr(s, field)
            if not (math.isfinite(value) and value > 0):
                raise UserError(f"{source}: rope_scaling.{field} = {value} must be a finite number > 0; fix the config")
        if s.type == "llama3" and s.high_freq_factor <= s.low_freq_factor:
            raise UserError(
                f"{source}: rope_scaling.high_freq_factor {s.high_freq_factor} must exceed "
                f"low_freq_factor {s.low_freq_factor}; fix the config"
            )


def check_weights(config: ModelConfig, weights: dict[str, Weight], source: str) -> None:
    for name, shape in expected_shapes(config).items():
        w = weights.get(name)
        if w is None:
            raise UserError(
                f"{source}: weight {name} is missing; the checkpoint is incomplete or not this architecture"
            )
        found = tuple(int(x) for x in w.shape)
        if found != shape:
            raise UserError(
                f"{source}: weight {name} has shape {list(found)}, expected {list(shape)} from the config; "
                "the config and weights do not match"
            )
        if isinstance(w, torch.Tensor) and not (w.dtype.is_floating_point and w.element_size() >= 2):
            raise UserError(
                f"{source}: weight {name} is {w.dtype}, not a float type (float32, float16, bfloat16) "
                "or a known quantized format; use the checkpoint as published"
            )


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_layer_count(config: ModelConfig, weights: dict[str, Weight], source: str) -> None:
    """Tensors of a layer past the count (MTP modules aside) mean the count is wrong: a layer would be dropped."""
    limit = config.num_layers + config.num_mtp_modules
    layers = [int(m.group(1)) for m in map(_LAYER.match, weights) if m]
    if layers and max(layers) >= limit:
        raise UserError(
            f"{source}: the weights have layer {max(layers)} but the config counts {config.num_layers} "
            f"layers (num_hidden_layers / block_count); the config and weights do not match"
        )


def check_tokenizer_fits(config: ModelConfig, tokenizer: Tokenizer, source: str) -> None:
    largest = tokenizer.largest_id()
    if largest >= config.vocab_size:
        raise UserError(
            f"{source}: the tokenizer has token id {largest} but the embedding holds {config.vocab_size} "
            "rows (vocab_size); the tokenizer and weights do not match"
        )
    if config.bos_token_id is not None and not 0 <= config.bos_token_id < config.vocab_size:
        raise UserError(
            f"{source}: bos_token_id {config.bos_token_id} is outside the vocabulary (0 to "
            f"{config.vocab_size - 1}); fix the config"
        )
