"""Precisions as first-class objects: how weights are stored (fp32 ... int4) and turned back into numbers.

Quantized weights are plain dataclasses of tensors so that every backend can read them without importing
anything backend-specific. The layouts here are a contract (DESIGN.md names the precisions; the packing below is
what kernels consume), so change them only together with the kernels and tests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from .errors import UserError

FP8_MAX = {"fp8-e4m3": 448.0, "fp8-e5m2": 57344.0}
FP8_DTYPES = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class Fp8Format:
    """One way of storing an fp8 precision: the OCP formats (the precisions' default storage) or the FNUZ ones
    (AMD gfx942), which have no inf and no negative zero, spend the byte 0x80 on their only NaN, and stop at a
    smaller maximum. Codecs saturate at `max`, so finite input never reaches a NaN or inf encoding."""

    precision: str  # the precision it stores: fp8-e4m3 or fp8-e5m2
    dtype: torch.dtype
    max: float
    has_inf: bool
    nan_bytes: tuple[int, ...]  # every byte that decodes to NaN

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


FP8_FORMATS: dict[torch.dtype, Fp8Format] = {
    f.dtype: f
    for f in (
        Fp8Format("fp8-e4m3", torch.float8_e4m3fn, 448.0, False, (0x7F, 0xFF)),
        Fp8Format("fp8-e5m2", torch.float8_e5m2, 57344.0, True, tuple(range(0x7D, 0x80)) + tuple(range(0xFD, 0x100))),
        Fp8Format("fp8-e4m3", torch.float8_e4m3fnuz, 240.0, False, (0x80,)),
        Fp8Format("fp8-e5m2", torch.float8_e5m2fnuz, 57344.0, False, (0x80,)),
    )
}
_FP8_NAME = {dtype: f.precision for dtype, f in FP8_FORMATS.items()}

# GGUF 4-bit blocks always hold 32 elements; bytes per block differ by the header (fp16 d, or d and m).
_GGUF_BLOCK = 32
_GGUF_HEADER_BYTES = {"Q4_0": 2, "Q4_1": 4}


# ---------------------------------------------------------------------------------------------------------------
# INT4


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [..., K] -> [..., K//2]; element 2i goes to the low nibble, 2i+1 to the high nibble."""
    if q.dtype != torch.uint8:
        raise UserError(
            f"pack_int4: expected a uint8 tensor of values 0..15, got {q.dtype}; cast with .to(torch.uint8)"
        )
    if q.shape[-1] % 2:
        raise UserError(f"pack_int4: last dimension {q.shape[-1]} is odd; int4 packing needs an even number of columns")
    if q.numel() and int(q.max()) > 15:
        raise UserError(f"pack_int4: values up to {int(q.max())} do not fit in 4 bits; clamp to 0..15 first")
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K//2] uint8 -> [..., K] uint8 values 0..15 (inverse of pack_int4)."""
    if packed.dtype != torch.uint8:
        raise UserError(f"unpack_int4: expected packed uint8 bytes, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


@dataclass
class Int4Weight:
    """Group-wise 4-bit weight: value = q * scale + offset per group of `group_size` columns."""

    packed: torch.Tensor  # uint8 [N, K//2]
    scales: torch.Tensor  # float32 [N, K//group_size]
    offsets: torch.Tensor  # float32 [N, K//group_size]
    group_size: int

    def __post_init__(self) -> None:
        # Catch layout mistakes at construction, where the caller still knows which tensor it was building.
        if self.packed.dtype != torch.uint8 or self.packed.dim() != 2:
            raise UserError(
                f"Int4Weight.packed must be a 2-D uint8 tensor, got {self.packed.dtype} {tuple(self.packed.shape)}"
            )
        n, k = self.shape
        if self.group_size <= 0 or k % self.group_size:
            raise UserError(f"Int4Weight: group_size {self.group_size} does not divide K={k}")
        groups = (n, k // self.group_size)
        for field in ("scales", "offsets"):
            t = getattr(self, field)
            if tuple(t.shape) != groups:
                raise UserError(
                    f"Int4Weight.{field} has shape {tuple(t.shape)}, expected {groups} for K={k}, "
                    f"group_size={self.group_size}"
                )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        q = unpack_int4(self.packed).view(n, k // self.group_size, self.group_size).float()
        w = q * self.scales.float().unsqueeze(-1) + self.offsets.float().unsqueeze(-1)
        return w.reshape(n, k).to(dtype)

    def select_rows(self, index: torch.Tensor) -> Int4Weight:
        index = index.to(self.packed.device)
        return Int4Weight(self.packed[index], self.scales[index], self.offsets[index], self.group_size)

    def to(self, device) -> Int4Weight:
        return Int4Weight(self.packed.to(device), self.scales.to(device), self.offsets.to(device), self.group_size)


def _check_group_size(w: torch.Tensor, group_size: int) -> None:
    k = w.shape[-1]
    if group_size <= 0 or group_size % 2:
        raise UserError(f"int4 group_size {group_size} is invalid; use 32, 64 or 128")
    if k % group_size:
        raise UserError(
            f"int4 group_size {group_size} does not divide the weight's K={k}; "
            f"pick a group size that divides it (32, 64 or 128) or keep this weight in a float precision"
        )


def _divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor, correctly rounded on every device. CUDA divides by a host scalar as a multiply by its
    reciprocal, off by a bit now and then: weights quantized at load on the GPU would differ from the CPU's."""
    return x / torch.tensor(divisor, dtype=x.dtype, device=x.device)


def int4_quantize(w: torch.Tensor, group_size: int = 128, symmetric: bool = True) -> Int4Weight:
    """Round-to-nearest per group; worst-case error is half a step (scale/2)."""
    if w.dim() != 2:
        raise UserError(f"int4_quantize: expected a 2-D [N, K] weight, got shape {tuple(w.shape)}")
    _check_group_size(w, group_size)
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        # amax/7 rather than /8: +amax and -amax both stay inside q-8 in -7..7, so nothing clips beyond scale/2.
        amax = g.abs().amax(dim=-1)
        scales = torch.where(amax > 0, _divide(amax, 7.0), torch.ones_like(amax))
        offsets = -8.0 * scales
    else:
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scales = torch.where(hi > lo, _divide(hi - lo, 15.0), torch.ones_like(hi))
        offsets = lo
    q = torch.round((g - offsets.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    return Int4Weight(pack_int4(q.reshape(n, k)), scales.contiguous(), offsets.contiguous(), group_size)


def int4_from_gguf(raw: np.ndarray | torch.Tensor, ggml_type: str, shape: tuple[int, int]) -> Int4Weight:
    """GGUF Q4_0/Q4_1 bytes -> Int4Weight (group_size 32) by moving nibbles only, so values match llama.cpp exactly."""
    if ggml_type not in _GGUF_HEADER_BYTES:
        raise UserError(f"int4_from_gguf: ggml type {ggml_type!r} is not supported; expected Q4_0 or Q4_1")
    n, k = shape
    if k % _GGUF_BLOCK:
        raise UserError(f"int4_from_gguf: K={k} is not a multiple of the GGUF block size {_GGUF_BLOCK}")
    header = _GGUF_HEADER_BYTES[ggml_type]
    block_bytes = header + _GGUF_BLOCK // 2
    if isinstance(raw, np.ndarray):
        # GGUFReader hands out read-only memmaps; torch wants a writable buffer.
        raw = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).copy())
    data = raw.contiguous().view(torch.uint8).reshape(-1)
    expected = n * (k // _GGUF_BLOCK) * block_bytes
    if data.numel() != expected:
        raise UserError(
            f"int4_from_gguf: {data.numel()} bytes do not match {ggml_type} shape {tuple(shape)} "
            f"({expected} bytes expected); "
            f"pass shape as (rows, cols) of the stored tensor"
        )
    blocks = data.view(n, k // _GGUF_BLOCK, block_bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    if ggml_type == "Q4_0":
        offsets = -8.0 * d  # (q - 8) * d == q * d - 8 * d exactly: d is fp16, so both products fit float32.
    else:
        offsets = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    nib = blocks[..., header:]
    # GGUF puts element j in the low nibble and j+16 in the high nibble of byte j; ours interleaves pairs.
    q = torch.cat((nib & 0x0F, nib >> 4), dim=-1).reshape(n, k)
    return Int4Weight(pack_int4(q), d.contiguous(), offsets.contiguous(), _GGUF_BLOCK)


# ---------------------------------------------------------------------------------------------------------------
# FP8


@dataclass
class Fp8Weight:
    """FP8 values with float32 multipliers: real = data.float() * scale, with scale [N, 1] (a row each) or [1, 1]
    (the tensor), or with block = (rows, columns) one per block, [ceil(N / rows), ceil(K / columns)], as
    DeepSeek-V3's and Qwen3's fp8 checkpoints store them. Kernels take the first two forms only: a precision's
    quantize turns a block-scaled weight into one of them (see Precision.quantize)."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.data.dtype not in _FP8_NAME or self.data.dim() != 2:
            raise UserError(
                f"Fp8Weight.data must be a 2-D float8 tensor, got {self.data.dtype} {tuple(self.data.shape)}"
            )
        if tuple(self.scale.shape) not in self._scale_shapes():
            want = " or ".join(str(s) for s in self._scale_shapes())
            raise UserError(f"Fp8Weight.scale has shape {tuple(self.scale.shape)}; expected {want}")

    def _scale_shapes(self) -> tuple[tuple[int, int], ...]:
        n, k = self.data.shape
        if self.block is None:
            return (n, 1), (1, 1)
        rows, cols = self.block
        return ((-(-n // rows), -(-k // cols)),)

    @property
    def fmt(self) -> str:
        return _FP8_NAME[self.data.dtype]

    @property
    def format(self) -> Fp8Format:
        return FP8_FORMATS[self.data.dtype]

    @property
    def per_channel(self) -> bool:
        return self.block is None and (self.scale.shape[0] != 1 or self.data.shape[0] == 1)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = self.scale.float()
        if self.block is not None:
            scale = block_multipliers(scale, self.block, self.shape)
        return (self.data.float() * scale).to(dtype)

    def select_rows(self, index: torch.Tensor) -> Fp8Weight:
        if self.block is not None:
            raise UserError(
                "Fp8Weight.select_rows: rows of a block-scaled weight do not keep their blocks; "
                "quantize it per row first (get_precision('fp8-e4m3').quantize)"
            )
        index = index.to(self.data.device)
        # Index through a uint8 view: not every device implements gather for float8 dtypes.
        data = self.data.view(torch.uint8)[index].view(self.data.dtype)
        scale = self.scale if self.scale.shape[0] == 1 else self.scale[index]
        return Fp8Weight(data, scale)

    def to(self, device) -> Fp8Weight:
        return Fp8Weight(self.data.to(device), self.scale.to(device), self.block)


def _fp8_format(fmt: str) -> str:
    if fmt not in FP8_MAX:
        raise UserError(f"unknown fp8 format {fmt!r}; use one of {', '.join(FP8_MAX)}")
    return fmt


def _storage(fmt: str, dtype: torch.dtype | None) -> torch.dtype:
    """The fp8 dtype storing precision `fmt`: its OCP default, or a format of FP8_FORMATS for that precision."""
    dtype = dtype or FP8_DTYPES[fmt]
    if dtype not in FP8_FORMATS or FP8_FORMATS[dtype].precision != fmt:
        raise UserError(
            f"{dtype} cannot store {fmt}; use one of "
            f"{', '.join(f.name for f in FP8_FORMATS.values() if f.precision == fmt)}"
        )
    return dtype


def _fp8_cast(
    x: torch.Tensor, amax: torch.Tensor, fmt: str, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale so amax lands on the format maximum, then saturate, so finite input never becomes inf/NaN (in the
    FNUZ formats an out-of-range cast would give NaN, having no inf)."""
    dtype = _storage(fmt, dtype)
    fmax = FP8_FORMATS[dtype].max
    scale = _divide(amax, fmax)
    # A tiny amax can underflow amax/fmax to 0; the smallest subnormal keeps x/scale finite and <= fmax.
    scale = torch.clamp(scale, min=torch.finfo(torch.float32).smallest_normal * 2.0**-23)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    data = (x / scale).clamp(-fmax, fmax).to(dtype)  # clamp keeps NaN, so NaN input stays NaN
    return data, scale


def _finite_amax(x: torch.Tensor, dim=None) -> torch.Tensor:
    # inf/NaN must not poison the scale of a whole row: inf saturates, NaN stays a lone NaN.
    a = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))
    return a.amax(dim=dim, keepdim=True) if dim is not None else a.amax().reshape(1, 1)


def fp8_quantize(
    w: torch.Tensor, fmt: str = "fp8-e4m3", per_channel: bool = True, dtype: torch.dtype | None = None
) -> Fp8Weight:
    """dtype: the storage (FP8_FORMATS) when not the precision's OCP default."""
    fmt = _fp8_format(fmt)
    if w.dim() != 2:
        raise UserError(f"fp8_quantize: expected a 2-D [N, K] weight, got shape {tuple(w.shape)}")
    x = w.float()
    data, scale = _fp8_cast(x, _finite_amax(x, dim=-1 if per_channel else None), fmt, dtype)
    return Fp8Weight(data, scale)


def block_multipliers(multipliers: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """One multiplier per block of block = (rows, columns) spread over a weight of `shape`, partial edge blocks
    cut: the multiplier of every element."""
    (rows, cols), (n, k) = block, shape
    return multipliers.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]


def fp8_block_weight(
    data: torch.Tensor, multipliers: torch.Tensor, block: tuple[int, int], name: str = "weight_scale"
) -> Fp8Weight:
    """A float8 [N, K] weight stored with one multiplier per block of block = (rows, columns), as DeepSeek-V3's
    and Qwen3's fp8 checkpoints store them (`weight_scale_inv`, [ceil(N / rows), ceil(K / columns)]); name: the
    multipliers' tensor, for errors."""
    n, k = data.shape
    rows, cols = block
    want = (-(-n // rows), -(-k // cols))
    if tuple(multipliers.shape) != want:
        raise UserError(
            f"{name} has shape {list(multipliers.shape)} but a {[n, k]} weight in blocks of {rows} x "
            f"{cols} needs {list(want)}; config.json's block size does not match the checkpoint, fix it "
            "or re-download the model"
        )
    return Fp8Weight(data, multipliers.float(), block)


def fp8_quantize_per_token(
    x: torch.Tensor, fmt: str = "fp8-e4m3", dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: one scale per row (token). Returns (fp8 [..., K], float32 scale [..., 1])."""
    fmt = _fp8_format(fmt)
    x = x.float()
    return _fp8_cast(x, _finite_amax(x, dim=-1), fmt, dtype)


# ---------------------------------------------------------------------------------------------------------------
# Any weight

Weight = torch.Tensor | Int4Weight | Fp8Weight


def concat_rows(weights: list[Weight]) -> Weight:
    """Stack weights along the output dimension (fused q/k/v, gate/up)."""
    if not weights:
        raise UserError("concat_rows: got no weights to concatenate")
    kinds = {type(w) for w in weights}
    if len(kinds) != 1:
        raise UserError(
            f"concat_rows: cannot mix weight types {sorted(k.__name__ for k in kinds)}; quantize them alike first"
        )
    ks = {w.shape[1] for w in weights}
    if len(ks) != 1:
        raise UserError(f"concat_rows: weights have different input sizes K={sorted(ks)}; only same-K weights fuse")
    first = weights[0]
    if isinstance(first, Int4Weight):
        if len({w.group_size for w in weights}) != 1:
            raise UserError("concat_rows: int4 weights use different group sizes; requantize them with one group size")
        return Int4Weight(
            torch.cat([w.packed for w in weights]),
            torch.cat([w.scales for w in weights]),
            torch.cat([w.offsets for w in weights]),
            first.group_size,
        )
    if isinstance(first, Fp8Weight):
        if len({w.data.dtype for w in weights}) != 1:
            raise UserError("concat_rows: fp8 weights mix e4m3 and e5m2; quantize them to one format")
        # Per-tensor scales differ between the parts, so the fused weight needs one scale per row.
        scales = [w.scale.expand(w.data.shape[0], 1) for w in weights]
        data = torch.cat([w.data.view(torch.uint8) for w in weights]).view(first.data.dtype)
        return Fp8Weight(data, torch.cat(scales).contiguous())
    return torch.cat(weights)


def _report_bad(name: str, bad: torch.Tensor, what: str, fix: str) -> None:
    count = int(bad.sum())
    if count:
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise UserError(f"weight {name!r}: {count} of {bad.numel()} {what} (first at index {first}); {fix}")


def validate_weight(name: str, w: Weight, fmt: str | None = None) -> None:
    """The "FP8 check": refuse weights whose stored values or scales would produce inf/NaN at run time."""
    fix = "the checkpoint is corrupt or was exported with a broken scale; re-export or pick another precision"
    if isinstance(w, Fp8Weight):
        wfmt = w.fmt
        if fmt is not None and fmt != wfmt:
            raise UserError(f"weight {name!r} is stored as {wfmt} but precision {fmt} was asked for; requantize it")
        fmax = w.format.max
        data = w.data.float()
        _report_bad(
            name,
            ~torch.isfinite(data) | (data.abs() > fmax),
            f"{w.format.name} values are inf/NaN or outside ±{fmax:g}",
            fix,
        )
        s = w.scale.float()
        _report_bad(name, ~torch.isfinite(s) | (s <= 0), "fp8 scales are not finite and positive", fix)
    elif isinstance(w, Int4Weight):
        _report_bad(name, ~torch.isfinite(w.scales.float()), "int4 scales are inf/NaN", fix)
        _report_bad(name, ~torch.isfinite(w.offsets.float()), "int4 offsets are inf/NaN", fix)
    elif isinstance(w, torch.Tensor):
        x = w.float()
        # amin / amax carry a NaN through: the elementwise mask (a table-sized temporary) only for a bad tensor.
        if x.numel() and not (torch.isfinite(x.amin()) and torch.isfinite(x.amax())):
            _report_bad(name, ~torch.isfinite(x), "values are inf/NaN", fix)
        if fmt in FP8_MAX:
            # A dense tensor meant to be cast to fp8 unscaled must already fit the format.
            fmax = FP8_MAX[fmt]
            _report_bad(
                name,
                x.abs() > fmax,
                f"values are outside the {fmt} range ±{fmax:g}",
                "quantize it with a scale (fp8_quantize)",
            )
    else:
        raise UserError(
            f"weight {name!r} has unsupported type {type(w).__name__}; expected a tensor, Int4Weight or Fp8Weight"
        )


def int4_group_size(k: int) -> int:
    """The group Precision.quantize gives an int4 weight of K columns: the largest of 128 / 64 / 32 dividing K."""
    return next((g for g in (128, 64, 32) if k % g == 0), 128)


def _dequantize(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    return w.dequantize(dtype) if isinstance(w, (Int4Weight, Fp8Weight)) else w.to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# Precision objects


@dataclass(frozen=True)
class Precision:
    name: str
    storage_dtype: torch.dtype
    activation_dtype: torch.dtype  # a suggestion; backends may compute in another dtype
    bits: int

    def quantize(self, w: Weight, group_size: int | None = None) -> Weight:
        """Convert to this precision; int4 picks the largest group of 128 / 64 / 32 dividing K unless told."""
        if self.name == "int4":
            if isinstance(w, Int4Weight):
                return w  # already int4 (GGUF path): requantizing would only add error
            group_size = group_size or int4_group_size(w.shape[-1])
            return int4_quantize(_dequantize(w, torch.float32), group_size=group_size)
        if self.name in FP8_MAX:
            if isinstance(w, Fp8Weight) and w.data.dtype == self.storage_dtype and w.block is None:
                return w
            # Block scales are rounded again to a scale a row, what the kernels take. That doubles the weights'
            # NMSE against their originals (2048 x 2048 normal or Student-t values: 7e-4 -> 1.4e-3) but not the
            # text's: SmolLM2 stored as 128 x 128 block fp8, Hamlet perplexity 40.845 as its values, 40.848
            # rounded again (benchmarks/bench_fp8_block_rounding.py).
            return fp8_quantize(_dequantize(w, torch.float32), fmt=self.name, dtype=self.storage_dtype)
        return _dequantize(w, self.storage_dtype)

    def stored_as(self, dtype: torch.dtype) -> Precision:
        """This fp8 precision kept in another format of FP8_FORMATS (a backend's choice: FNUZ on AMD gfx942)."""
        if self.name not in FP8_MAX:
            raise UserError(f"precision {self.name} has one storage format; only fp8 precisions take another")
        return replace(self, storage_dtype=_storage(self.name, dtype))

    def dequantize(self, w: Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return _dequantize(w, dtype)

    @property
    def head(self) -> Precision:
        """The precision of a quantized LM head (Profile.quantize_lm_head): the weights' own, but fp8-e4m3 for 4-bit
        weights. A head's rounding reaches every logit: on SmolLM2, Hamlet perplexity 25.86 with int4 weights, 29.81
        with an int4 head too (benchmarks/bench_lm_head_quality.py); llama.cpp keeps a 4-bit model's output tensor
        at 6-8 bits likewise."""
        return PRECISIONS["fp8-e4m3"] if self.bits < 8 else self

    def stored_bytes(self, rows: int, cols: int) -> int:
        """At least the bytes a [rows, cols] projection takes in this precision: int4 nibbles with a float32 scale
        and offset a group of 128 (smaller groups take more), fp8 bytes with a float32 scale a row."""
        if self.name == "int4":
            return rows * cols // 2 + rows * -(-cols // 128) * 8
        if self.name in FP8_MAX:
            return rows * cols + rows * 4
        return rows * cols * self.storage_dtype.itemsize


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", torch.float32, torch.float32, 32),
        Precision("bf16", torch.bfloat16, torch.bfloat16, 16),
        Precision("fp16", torch.float16, torch.float16, 16),
        Precision("fp8-e4m3", torch.float8_e4m3fn, torch.bfloat16, 8),
        Precision("fp8-e5m2", torch.float8_e5m2, torch.bfloat16, 8),
        Precision("int4", torch.uint8, torch.bfloat16, 4),
    )
}


def get_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except (KeyError, TypeError):
        raise UserError(f"unknown precision {name!r}; valid precisions: {', '.join(PRECISIONS)}") from None
