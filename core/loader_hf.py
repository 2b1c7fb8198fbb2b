"""Load an HF model folder (config.json + *.safetensors + tokenizer files), or an HF id through its cache."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from flashnext.core.config import ModelConfig, RopeScaling
from flashnext.core.errors import UserError
from flashnext.core.loaded_model import LoadedModel, check_model, sharded_model, shown
from flashnext.core.precision import FP8_DTYPES, Fp8Weight, Weight, fp8_block_weight
from flashnext.core.sharding import Shard, ShardPlan, slice_weight
from flashnext.core.tokenizer import Tokenizer

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MiMoForCausalLM": "qwen2",  # Xiaomi MiMo: Qwen2 blocks, plus MTP modules at model.mtp_layers (core/spec/mtp.py)
}

_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # safetensors' own limit


def looks_like_hf_id(text: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text)) and not text.startswith((".", "/"))


def resolve_hf_id(repo_id: str) -> Path:
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


def hf_folder_config(path: Path) -> ModelConfig:
    """The model's config alone (a tensor-parallel size is checked against it before any weight is read)."""
    return _config_from_hf(path / "config.json")[0]


def load_hf_folder(path: Path, shard: Shard | None = None) -> LoadedModel:
    """The folder's model; with `shard`, one tensor-parallel rank's slices of it, read through safetensors slices."""
    config, raw = _config_from_hf(path / "config.json")
    plan = shard.plan(config, str(path)) if shard else None
    weights = _fp8_checkpoint_weights(
        _load_safetensors_weights(path, plan), raw.get("quantization_config"), path / "config.json"
    )
    if plan:
        weights = _sliced_fp8(weights, plan)
    tokenizer = Tokenizer.from_hf_folder(path)
    if config.bos_token_id is None and tokenizer.bos_token_id is not None:
        config.bos_token_id = tokenizer.bos_token_id
    if not config.eos_token_ids:
        config.eos_token_ids = list(tokenizer.eos_token_ids)
    else:
        tokenizer.eos_token_ids = list(dict.fromkeys(list(config.eos_token_ids) + tokenizer.eos_token_ids))
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    if plan:
        return sharded_model(config, plan, weights, tokenizer, str(path), path.name)
    model = LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(path), name=path.name)
    check_model(model)
    return model


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
    if not path.is_file():
        raise UserError(f"{path}: not a regular file; pass the model's own files")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: invalid JSON ({exc}); fix or re-download the file") from None
    except RecursionError:
        raise UserError(f"{path}: JSON nested too deeply to be a model file; fix or re-download it") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror}); check the path and permissions") from None


def _config_from_hf(path: Path) -> tuple[ModelConfig, dict]:
    raw = _read_json_file(path)
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a JSON object; re-download the model's config.json")
    archs = raw.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list):
        raise UserError(f"{path}: field 'architectures' = {shown(archs)} must be a list of names; fix config.json")
    arch = next((HF_ARCHITECTURES[a] for a in archs if isinstance(a, str) and a in HF_ARCHITECTURES), None)
    if arch is None and not archs and raw.get("model_type") in HF_ARCHITECTURES.values():
        arch = raw["model_type"]
    if arch is None:
        named = ", ".join(map(str, archs)) or f"model_type {raw.get('model_type')!r}"
        raise UserError(f"{path}: architecture {named} is not supported; supported: {', '.join(HF_ARCHITECTURES)}")
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
    if (
        raw.get("use_sliding_window")
        and type(raw.get("sliding_window")) is int
        and type(data.get("max_position_embeddings", 0)) is int
    ):
        # Windowed layers attend to the last sliding_window keys only; up to that many tokens that is full attention.
        data["max_position_embeddings"] = min(
            data.get("max_position_embeddings", raw["sliding_window"]), raw["sliding_window"]
        )
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
        got = shown(err.get("input"))
        raise UserError(f"{path}: field '{field}' = {got} is invalid ({err.get('msg')}); fix config.json") from None


def _refuse_what_the_model_would_ignore(raw: dict, arch: str, path: Path) -> None:
    """Config fields that change the computation where the decoder has no branch for them (it runs SwiGLU MLPs
    without biases, and attention biases on q/k/v for Qwen2 only): refused rather than run wrongly."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(
            f"{path}: hidden_act {act!r} is not supported (these architectures run silu); use a Llama, "
            "Qwen2 or Qwen3 checkpoint as published"
        )
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
        raise UserError(f"{path}: rope_scaling type '{kind}' is not supported; supported: default, linear, llama3")
    fields = {k: scaling[k] for k in RopeScaling.model_fields if k != "type" and scaling.get(k) is not None}
    try:
        return RopeScaling(type=kind, **fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(x) for x in err.get("loc", ()))
        raise UserError(
            f"{path}: field 'rope_scaling.{field}' = {shown(err.get('input'))} is invalid ({err.get('msg')}); "
            "fix config.json"
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
        for shard in dict.fromkeys(map(str, wmap.values())):
            p = folder / shard
            if Path(shard).name != shard:
                raise UserError(
                    f"{index}: shard {shown(shard)} is not a file name in the model folder; re-download "
                    "the model's index file"
                )
            if not p.is_file():
                raise UserError(f"{p}: shard listed in {index.name} is missing; re-download the model")
            files.append(p)
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    if others:
        return others
    raise UserError(f"{folder}: no model.safetensors (or index); the folder needs the model's weights")


def _load_safetensors_weights(folder: Path, plan: ShardPlan | None = None) -> dict[str, Weight]:
    from safetensors import safe_open

    weights: dict[str, Weight] = {}
    for file in _safetensors_files(folder):
        _check_safetensors_file(file)
        try:
            with safe_open(str(file), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    if plan is None:
                        weights[name] = fh.get_tensor(name)
                    elif plan.keeps(name):
                        weights[name] = _read_slice(fh, name, plan)
        except UserError:
            raise
        except Exception as exc:
            msg = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
            raise UserError(f"{file}: cannot read safetensors ({msg}); re-download it") from None
    return weights


def _read_slice(fh, name: str, plan: ShardPlan) -> torch.Tensor:
    """Only this rank's rows or columns of a tensor. Float8 weights and their scales are read whole: their
    Fp8Weight is sliced once built (_sliced_fp8), where its scales' layout is known."""
    cut = plan.slice_of(name)
    piece = fh.get_slice(name)
    if cut is None or piece.get_dtype().startswith("F8"):
        return fh.get_tensor(name)
    dim, start, stop = cut
    return piece[start:stop] if dim == 0 else piece[:, start:stop]


def _sliced_fp8(weights: dict[str, Weight], plan: ShardPlan) -> dict[str, Weight]:
    out = {}
    for name, w in weights.items():
        cut = plan.slice_of(name)
        out[name] = slice_weight(w, *cut, name) if cut and isinstance(w, Fp8Weight) else w
    return out


# Scales an fp8 checkpoint may carry besides its weights' (static activation and KV-cache scales): the engine scales
# activations per token as it runs and keeps its KV cache in its own dtype, so they are not needed.
_FP8_STATIC_SCALES = (".input_scale", ".k_scale", ".v_scale", ".kv_scale")
_UNSUPPORTED_QUANT = (
    "use the unquantized checkpoint (--precision int4 or fp8-e4m3 quantizes it at load), a GGUF "
    "Q4_0 / Q4_1 file or an fp8 checkpoint"
)


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
        raise UserError(
            f"{config_path}: quantization_config.quant_method {method!r} is not supported; {_UNSUPPORTED_QUANT}"
        )
    if quant.get("format") != "float-quantized":
        raise UserError(
            f"{config_path}: quantization_config.format {quant.get('format')!r} is not supported (only "
            f"'float-quantized': fp8 weights); {_UNSUPPORTED_QUANT}"
        )
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
            raise UserError(
                f"{config_path}: {field}.strategy {w.get('strategy')!r} is not supported (tensor, "
                f"channel or block); {_UNSUPPORTED_QUANT}"
            )
    if len(blocks) > 1:
        raise UserError(
            f"{config_path}: quantization_config.config_groups use blocks {sorted(blocks)}; one block "
            "size for all weights is supported"
        )
    return blocks.pop() if blocks else None


def _block_size(block: Any, field: str, config_path: Path) -> tuple[int, int]:
    if isinstance(block, str) and "x" in block:  # compressed-tensors' older spelling, "128x128"
        block = block.split("x")
    try:
        rows, cols = (int(b) for b in block)
    except (TypeError, ValueError, OverflowError):
        rows = cols = 0
    if rows <= 0 or cols <= 0:
        raise UserError(
            f"{config_path}: quantization_config {field} is {block!r}; set it to the checkpoint's "
            "block, e.g. [128, 128]"
        )
    return rows, cols


def _fp8_checkpoint_weight(
    name: str, data: torch.Tensor, weights: dict, block: tuple[int, int] | None, config_path: Path
) -> Weight:
    scale_name = name + "_scale_inv" if name + "_scale_inv" in weights else name + "_scale"
    if scale_name not in weights:
        raise UserError(
            f"{config_path.parent}: {name} is float8 but the checkpoint has no {name}_scale or "
            f"{name}_scale_inv; it is incomplete, re-download it"
        )
    multipliers = weights[scale_name]
    if block is not None or scale_name.endswith("_inv"):
        if block is None:
            raise UserError(
                f"{config_path}: {scale_name} holds block scales but quantization_config has no "
                "weight_block_size; set it to the checkpoint's block, e.g. [128, 128]"
            )
        return fp8_block_weight(data, multipliers, block, f"{config_path.parent}: {scale_name}")
    rows = data.shape[0]
    if multipliers.numel() not in (1, rows):
        raise UserError(
            f"{config_path.parent}: {scale_name} has {multipliers.numel()} values, a float8 weight of "
            f"{rows} rows needs 1 or {rows}; re-download the model"
        )
    # One scale a row even where the checkpoint has one a tensor: the fused and skinny fp8 kernels take rows.
    return Fp8Weight(data, multipliers.float().reshape(-1, 1).expand(rows, 1).contiguous())
