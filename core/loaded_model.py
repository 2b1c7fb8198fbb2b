"""What a loader hands back, and the shape check every loader runs before it does."""

from __future__ import annotations

from dataclasses import dataclass

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


def check_weights(config: ModelConfig, weights: dict[str, Weight], source: str) -> None:
    for name, shape in expected_shapes(config).items():
        w = weights.get(name)
        if w is None:
            raise UserError(f"{source}: weight {name} is missing; the checkpoint is incomplete or not this architecture")
        found = tuple(int(x) for x in w.shape)
        if found != shape:
            raise UserError(
                f"{source}: weight {name} has shape {list(found)}, expected {list(shape)} from the config; "
                "the config and weights do not match"
            )
