"""Row-wise Triton kernels: rmsnorm (with the residual add) and SiLU-and-mul, each able to write its output already
quantized for the projection after it, so that projection needs no quantization pass."""

import triton
import triton.language as tl

from .primitives import _after_producer
from .quant import _quantize_row, _store_int8_groups


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    w_ptr,
    out_ptr,
    K,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    fp8_ptr=None,
    scale_ptr=None,
    FMAX: tl.constexpr = 0.0,
    sum_ptr=None,
    INT8_GROUP: tl.constexpr = 0,
):
    """rmsnorm(x (+ res)); with FMAX the normalized row goes out as per-token fp8 (fp8_ptr, scale_ptr) instead,
    bit-equal to normalizing and then quantizing in two passes; with INT8_GROUP as Int8Rows (fp8_ptr, scale_ptr,
    sum_ptr)."""
    _after_producer(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    x = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0)
    if HAS_RES:
        # The reference adds in the activation dtype, then normalizes the rounded sum.
        x = x.to(tl.float32) + tl.load(res_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * K + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (xf * rms * w).to(out_ptr.dtype.element_ty)
    if FMAX > 0:
        _quantize_row(normed.to(tl.float32), fp8_ptr + row * K + cols, mask, scale_ptr + row, FMAX)
    elif INT8_GROUP > 0:
        groups = K // INT8_GROUP
        _store_int8_groups(
            normed.to(tl.float32),
            0,
            K,
            fp8_ptr + row * K,
            scale_ptr + row * groups,
            sum_ptr + row * groups,
            BLOCK_K,
            INT8_GROUP,
        )
    else:
        tl.store(out_ptr + row * K + cols, normed, mask=mask)


@triton.jit
def _silu_mul_kernel(
    x_ptr,
    out_ptr,
    N,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    scale_ptr=None,
    FMAX: tl.constexpr = 0.0,
    sum_ptr=None,
    INT8_GROUP: tl.constexpr = 0,
):
    """silu(gate) * up; with FMAX out takes each program's BLOCK columns as fp8 and scale_ptr their scale
    ([rows, programs along the row]: one program a row, BLOCK >= N, makes it per token); with INT8_GROUP (which
    divides BLOCK) out, scale_ptr and sum_ptr take Int8Rows."""
    _after_producer(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    gate = tl.load(x_ptr + row * 2 * N + cols, mask=m, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * N + N + cols, mask=m, other=0.0)
    # F.silu rounds to the activation dtype before the product, as the reference does.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    act = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
    if FMAX > 0:
        _quantize_row(
            act.to(tl.float32),
            out_ptr + row * N + cols,
            m,
            scale_ptr + row * tl.num_programs(1) + tl.program_id(1),
            FMAX,
        )
    elif INT8_GROUP > 0:
        groups = N // INT8_GROUP
        _store_int8_groups(
            act.to(tl.float32),
            tl.program_id(1) * BLOCK,
            N,
            out_ptr + row * N,
            scale_ptr + row * groups,
            sum_ptr + row * groups,
            BLOCK,
            INT8_GROUP,
        )
    else:
        tl.store(out_ptr + row * N + cols, act, mask=m)
