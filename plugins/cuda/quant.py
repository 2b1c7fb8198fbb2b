"""Quantization on the device: per-token fp8 and per-group int8 activations, int4 weight tiles and the int4
dequantization pass, and the containers (Fp8Rows, Int8Rows) in which quantized activations reach the projection
that takes them."""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .primitives import _after_producer, gdc_launch_dependents, gdc_wait


@triton.jit
def _fp8_quant_rows_kernel(x_ptr, q_ptr, scale_ptr, K, FMAX: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    _after_producer(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    m = cols < K
    x = tl.load(x_ptr + row * K + cols, mask=m, other=0.0).to(tl.float32)
    _quantize_row(x, q_ptr + row * K + cols, m, scale_ptr + row, FMAX)


@triton.jit
def _int8_quant_rows_kernel(
    x_ptr, q_ptr, scale_ptr, sum_ptr, K, GROUP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    _after_producer(PDL)
    row, first = tl.program_id(0), tl.program_id(1) * BLOCK
    cols = first + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * K + cols, mask=cols < K, other=0.0).to(tl.float32)
    _store_int8_groups(
        x, first, K, q_ptr + row * K, scale_ptr + row * (K // GROUP), sum_ptr + row * (K // GROUP), BLOCK, GROUP
    )


@triton.jit
def _quantize_row(x, q_ptrs, m, scale_ptr, FMAX: tl.constexpr):
    """Dynamic per-token activation scale: amax of the row's finite values (x, float32, 0 where not m) lands on
    the format maximum; stores the fp8 row at q_ptrs and its scale."""
    scale = _fp8_scale(_finite_amax(x, 0), FMAX)
    tl.store(q_ptrs, _fp8_values(x, scale, FMAX).to(q_ptrs.dtype.element_ty), mask=m)
    tl.store(scale_ptr, scale)


@triton.jit
def _finite_amax(x, axis: tl.constexpr):
    return tl.max(tl.where(tl.abs(x) < float("inf"), tl.abs(x), 0.0), axis=axis)


@triton.jit
def _fp8_scale(amax, FMAX: tl.constexpr):
    """The scale that puts amax on the format maximum (1 for an all-zero group)."""
    # Floor at the smallest fp32 subnormal (bit pattern 1), written as bits: a literal that small becomes fp64.
    tiny = tl.full([], 1, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(amax > 0, tl.maximum(amax / FMAX, tiny), 1.0)


@triton.jit
def _fp8_values(x, scale, FMAX: tl.constexpr):
    """x / scale clamped to the format's range, in float32 (the caller rounds it to fp8)."""
    q = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
    return tl.where(x == x, q, x)  # min/max drop NaN; a NaN activation must stay NaN through the product


@triton.jit
def _int8_blocks(xb):
    """xb [blocks, columns] float32 rounded to int8 a block at a time, scaled to the block's largest magnitude:
    (the integers as int32, the block scales, the blocks' integer sums as floats). A NaN or inf in a block makes its
    scale NaN (x * 0 is NaN there only): the output goes NaN as a float dot's would, rather than the rounding to
    int8 silently dropping it. An all-zero block rounds to 0s."""
    amax = tl.max(tl.abs(xb), axis=1)
    xi = tl.floor(xb * (127.0 / tl.maximum(amax, 1e-30))[:, None] + 0.5).to(tl.int32)
    return xi, amax / 127.0 + tl.sum(xb * 0.0, axis=1), tl.sum(xi, axis=1).to(tl.float32)


@triton.jit
def _store_int8_groups(x, first, K, data_ptr, scale_ptr, sum_ptr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """One row's Int8Rows at columns first .. first + BLOCK (first on a group boundary) of x (float32 [BLOCK], 0
    past K), row pointers given: each group rounded to int8 at its largest magnitude / 127, its even columns
    stored before its odd ones (the order _int4_int8_step reads), its scale and the sum of its integers
    (_int8_blocks: the int4 GEMV's rounding)."""
    xi, scale, sums = _int8_blocks(tl.reshape(x, (BLOCK // GROUP, GROUP)))
    cols = first + tl.arange(0, BLOCK)
    j = cols % GROUP
    tl.store(data_ptr + cols - j + (j % 2) * (GROUP // 2) + j // 2, tl.reshape(xi, (BLOCK,)).to(tl.int8), mask=cols < K)
    g = first // GROUP + tl.arange(0, BLOCK // GROUP)
    tl.store(scale_ptr + g, scale, mask=g * GROUP < K)
    tl.store(sum_ptr + g, sums, mask=g * GROUP < K)


@triton.jit
def _int4_tile(
    packed_ptr,
    scales_ptr,
    offsets_ptr,
    rows,
    rows_ok,
    K,
    first,
    GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Int4Weight rows `rows`, columns first .. first + BLOCK_K (a multiple of GROUP; 0 past K), as float32 values
    q * scale + offset: byte i's nibbles (columns 2i, 2i + 1) interleaved in registers by join. EVEN_K: the tile
    lies inside K, so the loads take row masks only (a mask along K keeps a GEMM's loads out of its software
    pipeline)."""
    half = first // 2 + tl.arange(0, BLOCK_K // 2)
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    g = first // GROUP + tl.arange(0, GROUPS)
    if EVEN_K:
        p_ok, g_ok = rows_ok[:, None], rows_ok[:, None]
    else:
        p_ok = rows_ok[:, None] & (half < K // 2)[None, :]
        g_ok = rows_ok[:, None] & (g < K // GROUP)[None, :]
    p = tl.load(packed_ptr + rows[:, None] * (K // 2) + half[None, :], mask=p_ok, other=0)
    q = tl.reshape(tl.join(p & 0xF, p >> 4), (BLOCK_R, BLOCK_K)).to(tl.float32)
    s = tl.load(scales_ptr + rows[:, None] * (K // GROUP) + g[None, :], mask=g_ok, other=0.0)
    o = tl.load(offsets_ptr + rows[:, None] * (K // GROUP) + g[None, :], mask=g_ok, other=0.0)
    return tl.reshape(tl.reshape(q, (BLOCK_R, GROUPS, GROUP)) * s[:, :, None] + o[:, :, None], (BLOCK_R, BLOCK_K))


@triton.jit
def _int4_dequant_kernel(
    packed_ptr,
    scales_ptr,
    offsets_ptr,
    out_ptr,
    N,
    K,
    GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """One pass from Int4Weight to a 16-bit [N, K] weight (then a GEMM): a program takes BLOCK_R rows x BLOCK_K
    columns; byte i's nibbles (columns 2i, 2i + 1) are interleaved in registers, so each thread stores contiguous
    16-bit runs (a program a row with two stride-2 stores took twice as long).

    Under programmatic dependent launch it waits for its producer (the buffer it writes may be the one the GEMM
    before it reads) but releases the GEMM after it only at its end: released at the start, that GEMM's programs
    sit waiting on SMs this pass, several waves long, still needs."""
    if PDL:
        gdc_wait()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    first = tl.program_id(1) * BLOCK_K
    rows_ok = rows < N
    w = _int4_tile(packed_ptr, scales_ptr, offsets_ptr, rows, rows_ok, K, first, GROUP, BLOCK_R, BLOCK_K, False)
    cols = first + tl.arange(0, BLOCK_K)
    tl.store(
        out_ptr + rows[:, None] * K + cols[None, :],
        w.to(out_ptr.dtype.element_ty),
        mask=rows_ok[:, None] & (cols < K)[None, :],
    )
    if PDL:
        gdc_launch_dependents()


@dataclass
class _QuantizedRows:
    """Activations a projection takes quantized, data [rows, K] with their scales: shaped as the rows they stand
    for, so routing code reads them as it reads a tensor."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device


@dataclass
class Fp8Rows(_QuantizedRows):
    """Activations quantized to fp8-e4m3 by the kernel that produced them (an rmsnorm, SiLU-and-mul or decode
    attention ahead of an fp8 projection), so the projection needs no quantization pass: data [rows, K], scale
    [rows, 1] per token, or with group > 0 (a power of two) [rows, ceil(K / group)], a scale per token and group
    of columns."""

    dtype: torch.dtype  # the activations' own 16-bit dtype: what the projection writes
    group: int = 0


def _empty_fp8_rows(rows: int, k: int, like: torch.Tensor, group: int = 0) -> Fp8Rows:
    """Fp8Rows to be written: a scale per token, or with group > 0 per token and group of columns."""
    scales = triton.cdiv(k, group) if group else 1
    return Fp8Rows(
        torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=like.device),
        torch.empty(rows, scales, dtype=torch.float32, device=like.device),
        like.dtype,
        group,
    )


@dataclass
class Int8Rows(_QuantizedRows):
    """Activations rounded to int8 a group of columns at a time (the group of the int4 weight they meet) by the
    kernel that produced them or a pass (CudaKernels.int8_quantize_rows): data [rows, K] int8, each group's
    even columns before its odd ones (_store_int8_groups), scale and sums [rows, K / group] float32 (a group's
    largest magnitude / 127, and the sum of its integers, which the weight's offsets multiply)."""

    sums: torch.Tensor
    dtype: torch.dtype  # the activations' own 16-bit dtype: what the projection writes
    group: int


def _empty_int8_rows(rows: int, k: int, like: torch.Tensor, group: int) -> Int8Rows:
    groups = (rows, k // group)
    return Int8Rows(
        torch.empty(rows, k, dtype=torch.int8, device=like.device),
        torch.empty(groups, dtype=torch.float32, device=like.device),
        torch.empty(groups, dtype=torch.float32, device=like.device),
        like.dtype,
        group,
    )
