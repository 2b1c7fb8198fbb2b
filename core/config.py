"""Model architecture description shared by every loader and backend."""

from typing import Literal

from pydantic import BaseModel, Field

Architecture = Literal["llama", "qwen2", "qwen3"]


class RopeScaling(BaseModel):
    """Rope frequency scaling as HF configs describe it; `type` is HF's `rope_type`."""

    type: Literal["default", "linear", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelConfig(BaseModel):
    """One decoder of the Llama / Qwen2 / Qwen3 dense family. Field bounds reject absurd configs early."""

    architecture: Architecture
    vocab_size: int = Field(gt=0, le=4_000_000)
    hidden_size: int = Field(gt=0, le=65_536)
    intermediate_size: int = Field(gt=0, le=1_000_000)
    num_layers: int = Field(gt=0, le=1_000)
    num_heads: int = Field(gt=0, le=1_024)
    num_kv_heads: int = Field(gt=0, le=1_024)
    head_dim: int = Field(gt=0, le=1_024)
    rms_norm_eps: float = Field(default=1e-6, gt=0, lt=1)
    rope_theta: float = Field(default=10_000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = Field(default=4096, gt=0, le=10_000_000)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    bos_token_id: int | None = None
    eos_token_ids: list[int] = Field(default_factory=list)
    # MTP depth modules carried by the checkpoint (DeepSeek-V3 `num_nextn_predict_layers`); 0 = none.
    num_mtp_modules: int = Field(default=0, ge=0, le=16)
