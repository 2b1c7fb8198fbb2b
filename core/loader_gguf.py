"""Load a GGUF file: llama.cpp's tensor names mapped to HF's, q/k rows un-permuted, Q4_0/Q4_1 kept as int4."""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError

from flashnext.core import model_cache
from flashnext.core.config import ModelConfig, RopeScaling
from flashnext.core.errors import UserError
from flashnext.core.loaded_model import LoadedModel, check_model, sharded_model, shown
from flashnext.core.precision import Weight, int4_from_gguf
from flashnext.core.sharding import Shard, ShardPlan
from flashnext.core.tokenizer import Tokenizer

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

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
_DEQUANTIZE_ROWS = 4096
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_INTEGER_TYPES = ("I8", "I16", "I32", "I64")


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


def _gguf_count(reader, key: str, path: Path, default=None) -> int | None:
    """A whole-number metadata value (a per-layer list must hold one value for every layer)."""
    value = _gguf_value(reader, key, default)
    if isinstance(value, list) and value and all(v == value[0] for v in value):
        value = value[0]
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise UserError(
        f"{path}: GGUF metadata {key} = {shown(value)} is not a whole number (per-layer values "
        "must all be equal); the file is damaged or not supported, use another GGUF"
    )


def _gguf_float(reader, key: str, path: Path, default: float) -> float:
    value = _gguf_value(reader, key, default)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise UserError(
        f"{path}: GGUF metadata {key} = {shown(value)} is not a finite number > 0; the file is "
        "damaged, use another GGUF"
    )


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
        if not path.is_file():
            raise UserError(f"{path}: not a regular file; pass a .gguf model file")
        entry = model_cache.entry_for(path)
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror}); check the path") from None
    cached = model_cache.load(entry, str(path)) if entry else None
    if cached:
        config, weights, tokenizer = cached
        model = LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(path), name=path.stem)
        try:
            check_model(model)
            return model
        except UserError as exc:
            model_cache.discard(entry, str(exc))
    loaded = _parse_gguf(path)
    if entry:
        with contextlib.suppress(OSError):  # a read-only home only costs speed
            model_cache.save(entry, path, loaded.config, loaded.weights, loaded.tokenizer)
    return loaded


def gguf_config(path: str | Path) -> ModelConfig:
    """The model's config alone, from the header or its converted copy (a tensor-parallel size is checked
    against it first)."""
    entry = model_cache.entry_for(Path(path))
    return (entry and model_cache.cached_config(entry)) or _open_gguf(Path(path))[2]


def load_gguf_shard(path: str | Path, shard: Shard) -> LoadedModel:
    """One tensor-parallel rank's slices of a GGUF, cut from the memory map before anything is decoded: rows of a
    quantized tensor are whole blocks, so slicing output rows is exact; input columns are sliced on block
    boundaries (a size that would cut a block is refused). From the converted-model cache where it holds the
    file (slices of its safetensors), else from the GGUF itself (no entry is written: that would convert it all)."""
    path = Path(path)
    entry = model_cache.entry_for(path)
    cached = model_cache.load(entry, str(path), shard) if entry else None
    if cached:
        config, weights, tokenizer = cached
        return sharded_model(config, shard.plan(config, str(path)), weights, tokenizer, str(path), path.stem)
    reader, tokenizer, config = _open_gguf(path)
    plan = shard.plan(config, str(path))
    local = plan.local_config()
    weights = _gguf_weights(reader, path, local, plan)
    config.rope_scaling = local.rope_scaling  # where rope_freqs.weight told it (plan.config is this object)
    return sharded_model(config, plan, weights, tokenizer, str(path), path.stem)


def _parse_gguf(path: Path) -> LoadedModel:
    reader, tokenizer, config = _open_gguf(path)
    weights = _gguf_weights(reader, path, config)
    model = LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(path), name=path.stem)
    check_model(model)
    return model


def _open_gguf(path: Path):
    """(reader over the memory map, tokenizer, config) of a GGUF whose layout was checked first."""
    import gguf

    try:
        check_gguf_layout(path)
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror}); check the path") from None
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:
        msg = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise UserError(
            f"{path}: not a readable GGUF file ({msg}); the file is damaged or truncated, re-download it"
        ) from None
    src = str(path)

    arch = _gguf_value(reader, "general.architecture")
    if arch is None and "general.architecture" in reader.fields:
        raise UserError(f"{path}: GGUF metadata general.architecture is not UTF-8 text; the file is damaged")
    if arch not in GGUF_ARCHITECTURES:
        raise UserError(f"{path}: architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}")

    tokenizer = Tokenizer.from_gguf(reader, source=src)
    tensor_names = {t.name for t in reader.tensors}

    def req(key: str) -> int:
        v = _gguf_count(reader, f"{arch}.{key}", path)
        if v is None:
            raise UserError(f"{path}: GGUF metadata {arch}.{key} is missing; the file is incomplete, use another GGUF")
        return v

    hidden = req("embedding_length")
    heads = req("attention.head_count")
    kv_heads = _gguf_count(reader, f"{arch}.attention.head_count_kv", path, heads)
    head_dim = _gguf_count(reader, f"{arch}.attention.key_length", path) or (hidden // heads if heads else 0)
    vocab = _gguf_count(reader, f"{arch}.vocab_size", path)
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0
    data: dict[str, Any] = {
        "architecture": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": req("feed_forward_length"),
        "num_layers": req("block_count"),
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _gguf_float(reader, f"{arch}.attention.layer_norm_rms_epsilon", path, 1e-6),
        "rope_theta": _gguf_float(reader, f"{arch}.rope.freq_base", path, 10_000.0),
        "max_position_embeddings": _gguf_count(reader, f"{arch}.context_length", path, 4096),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "qkv_bias": "blk.0.attn_q.bias" in tensor_names,
        "qk_norm": arch == "qwen3",
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_ids": list(tokenizer.eos_token_ids),
        "num_mtp_modules": _gguf_count(reader, f"{arch}.nextn_predict_layers", path, 0),
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
    return reader, tokenizer, config


def _gguf_weights(reader, path: Path, config: ModelConfig, plan: ShardPlan | None = None) -> dict[str, Weight]:
    """Every tensor under its HF name (with a plan, this rank's slices; config is then the rank's own, whose
    head counts un-permute the sliced q/k rows: llama.cpp permutes within each head)."""
    arch = config.architecture
    weights: dict[str, Weight] = {}
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        if t.tensor_type.name in _INTEGER_TYPES:
            raise UserError(
                f"{path}: tensor {t.name} is {t.tensor_type.name}, not a float or quantized weight type; "
                "use a GGUF as llama.cpp converts it"
            )
        if plan is not None and not plan.keeps(name):
            continue
        try:
            cut = plan.slice_of(name) if plan is not None else None
            weights[name] = _gguf_tensor(t) if cut is None else _gguf_tensor_slice(t, *cut, path)
        except UserError:
            raise
        except Exception as exc:
            raise UserError(
                f"{path}: cannot decode tensor {t.name} ({type(exc).__name__}: {exc}); re-download the file"
            ) from None

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
    return weights


def _gguf_tensor(t) -> Weight:
    shape = tuple(int(x) for x in reversed([int(d) for d in t.shape]))  # GGUF lists ne0 (columns) first
    return _decode(t.data, t.tensor_type, shape)


def _gguf_tensor_slice(t, dim: int, start: int, stop: int, path: Path) -> Weight:
    """Rows or columns [start, stop) of a tensor, cut from the memory-mapped bytes before decoding. The reader
    shows a quantized (or bf16) tensor as [rows, bytes a row] of whole blocks, a float one as [rows, columns]."""
    from gguf import GGML_QUANT_SIZES

    shape = [int(x) for x in reversed([int(d) for d in t.shape])]
    data = t.data
    if dim == 0:
        data = data[start:stop]
    else:
        block, block_bytes = GGML_QUANT_SIZES[t.tensor_type]
        if data.dtype == np.uint8:
            if start % block or stop % block:
                raise UserError(
                    f"{path}: tensor {t.name} is {t.tensor_type.name} in blocks of {block} columns; a rank's "
                    f"columns {start}..{stop} would cut a block: use a tensor-parallel size that keeps whole blocks"
                )
            data = data[:, start // block * block_bytes : stop // block * block_bytes]
        else:
            data = data[:, start:stop]
    shape[dim] = stop - start
    return _decode(data, t.tensor_type, tuple(shape))


def _decode(data, tensor_type, shape: tuple[int, ...]) -> Weight:
    from gguf import quants

    type_name = tensor_type.name
    if type_name in _FLOAT_TYPES:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1).copy()
        return torch.from_numpy(raw).view(_FLOAT_TYPES[type_name]).reshape(shape)
    if type_name in ("Q4_0", "Q4_1") and len(shape) == 2:
        return int4_from_gguf(np.ascontiguousarray(data), type_name, shape)
    data = np.ascontiguousarray(data)
    rows = data.reshape(-1, data.shape[-1])
    out = torch.empty(rows.shape[0], math.prod(shape) // rows.shape[0])
    # In row chunks: the reader's dequantize holds about twice its result in temporaries (217 MiB for SmolLM2's
    # 108 MiB embedding table), which would otherwise set the load's peak memory.
    for first in range(0, rows.shape[0], _DEQUANTIZE_ROWS):
        part = quants.dequantize(rows[first : first + _DEQUANTIZE_ROWS], tensor_type)
        out[first : first + len(part)] = torch.from_numpy(part.reshape(len(part), -1))
    return out.reshape(shape)


def _gguf_rope_scaling(reader, arch: str, path: Path) -> RopeScaling | None:
    kind = _gguf_value(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return RopeScaling(type="linear", factor=_gguf_float(reader, f"{arch}.rope.scaling.factor", path, 1.0))
    raise UserError(f"{path}: rope scaling {kind!r} is not supported; supported: none, linear, llama3 (rope_freqs)")


def _llama3_factors(head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    wavelen = 2 * math.pi / inv
    low_wl = s.original_max_position_embeddings / s.low_freq_factor
    high_wl = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
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
            s = RopeScaling(
                type="llama3",
                factor=factor,
                low_freq_factor=low,
                high_freq_factor=high,
                original_max_position_embeddings=orig,
            )
            if torch.allclose(_llama3_factors(config.head_dim, config.rope_theta, s), f, rtol=1e-3, atol=1e-3):
                return s
    raise UserError(f"{path}: rope_freqs.weight does not match llama3 rope scaling; this GGUF is not supported")


# ---------------------------------------------------------------------------------------------------------------
# layout: every count, length and offset checked against the file's own size before the gguf reader allocates

_GGUF_VERSIONS = (2, 3)
_GGUF_MAX_DIMS = 4
_GGUF_DEFAULT_ALIGNMENT = 32
# value type -> struct format of one item (STRING 8 and ARRAY 9 are read item by item)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _Bounded:
    """A cursor over the file's bytes that refuses to read past its end."""

    def __init__(self, buf, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise UserError(
                f"{self.path}: {what} needs {n} bytes at offset {self.pos} but the file has {self.size}; "
                "the file is truncated or damaged, re-download it"
            )

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize("<" + fmt)
        self.need(n, what)
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str) -> bytes:
        n = self.unpack("Q", f"{what} length")
        self.need(n, what)
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos])

    def skip_value(self, vtype: int, key: str) -> None:
        if vtype in _GGUF_SCALARS:
            self.unpack(_GGUF_SCALARS[vtype], f"metadata {key}")
        elif vtype == _GGUF_STRING:
            self.string(f"metadata {key}")
        elif vtype == _GGUF_ARRAY:
            item = self.unpack("I", f"metadata {key} item type")
            count = self.unpack("Q", f"metadata {key} count")
            if item in _GGUF_SCALARS:
                self.need(count * struct.calcsize("<" + _GGUF_SCALARS[item]), f"metadata {key} ({count} items)")
                self.pos += count * struct.calcsize("<" + _GGUF_SCALARS[item])
            elif item == _GGUF_STRING:
                self.need(count * 8, f"metadata {key} ({count} strings)")
                for _ in range(count):
                    self.string(f"metadata {key} item")
            else:
                raise UserError(
                    f"{self.path}: metadata {key} is an array of type {item}, which GGUF does not "
                    "define here; the file is damaged, re-download it"
                )
        else:
            raise UserError(
                f"{self.path}: metadata {key} has value type {vtype}, which GGUF does not define; "
                "the file is damaged, re-download it"
            )


def check_gguf_layout(path: Path) -> None:
    """Walk the header with every length bounded by the file, then check each tensor's type, shape, alignment and
    extent, so the gguf reader never loops on reads past the end or maps weights out of the header."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as fh:
        head = fh.read(4)
        if head != b"GGUF":
            raise UserError(
                f"{path}: not a GGUF file (bad magic: the file starts with {head!r}, a GGUF with "
                "b'GGUF'); pass a .gguf model file"
            )
        if os.fstat(fh.fileno()).st_size < 24:
            raise UserError(f"{path}: truncated GGUF file (no room for its header); re-download it")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cur = _Bounded(buf, path)
            cur.pos = 4
            version = cur.unpack("I", "version")
            if version not in _GGUF_VERSIONS:
                raise UserError(
                    f"{path}: GGUF version {version} is not supported (only {_GGUF_VERSIONS}); convert "
                    "the model with a current llama.cpp"
                )
            n_tensors = cur.unpack("Q", "tensor count")
            n_kv = cur.unpack("Q", "metadata count")
            cur.need(n_kv * 12, f"{n_kv} metadata entries")
            alignment = _GGUF_DEFAULT_ALIGNMENT
            for _ in range(n_kv):
                key = cur.string("metadata key").decode("utf-8", errors="replace")
                vtype = cur.unpack("I", f"metadata {key} type")
                if key == "general.alignment":
                    if vtype != 4:
                        raise UserError(
                            f"{path}: metadata general.alignment has type {vtype}, GGUF requires uint32; "
                            "the file is damaged"
                        )
                    alignment = cur.unpack("I", "general.alignment")
                    if alignment == 0 or alignment & (alignment - 1):
                        raise UserError(
                            f"{path}: metadata general.alignment = {alignment} is not a power of two; "
                            "the file is damaged"
                        )
                else:
                    cur.skip_value(vtype, key)
            cur.need(n_tensors * 24, f"{n_tensors} tensor descriptions")
            tensors = []
            for _ in range(n_tensors):
                name = cur.string("tensor name").decode("utf-8", errors="replace")
                n_dims = cur.unpack("I", f"tensor {name} dimension count")
                if not 1 <= n_dims <= _GGUF_MAX_DIMS:
                    raise UserError(
                        f"{path}: tensor {name} has {n_dims} dimensions (GGUF allows 1 to "
                        f"{_GGUF_MAX_DIMS}); the file is damaged"
                    )
                dims = [cur.unpack("Q", f"tensor {name} shape") for _ in range(n_dims)]
                ttype = cur.unpack("I", f"tensor {name} type")
                offset = cur.unpack("Q", f"tensor {name} offset")
                tensors.append((name, dims, ttype, offset))
            data_start = -(-cur.pos // alignment) * alignment
    for name, dims, ttype, offset in tensors:
        _check_gguf_tensor(
            path, name, dims, ttype, offset, alignment, data_start, cur.size, GGML_QUANT_SIZES, GGMLQuantizationType
        )


def _check_gguf_tensor(path, name, dims, ttype, offset, alignment, data_start, size, quant_sizes, qtypes) -> None:
    try:
        qtype = qtypes(ttype)
        block, block_bytes = quant_sizes[qtype]
    except (ValueError, KeyError):
        raise UserError(
            f"{path}: tensor {name} has type {ttype}, which this gguf library does not know; use a "
            "GGUF with standard tensor types"
        ) from None
    if min(dims) == 0 or dims[0] % block:
        raise UserError(
            f"{path}: tensor {name} has shape {dims}, not a whole number of {qtype.name} blocks of "
            f"{block}; the file is damaged"
        )
    n_bytes = math.prod(dims) // block * block_bytes
    if offset % alignment:
        raise UserError(
            f"{path}: tensor {name} offset {offset} is not a multiple of the alignment {alignment}; "
            "the file is damaged, re-download it"
        )
    if data_start + offset + n_bytes > size:
        raise UserError(
            f"{path}: tensor {name} (offset {offset}, {n_bytes} bytes) extends past the end of the "
            f"file ({size} bytes); the file is truncated, re-download it"
        )
