"""Where the ROCm kernels route projections away from the shared ones: FP8 in the weights' own format (FNUZ on
gfx942, OCP on gfx950; the shared Triton kernels write fp8 activations as OCP e4m3, which FNUZ weights cannot meet
in one product), and int4 past the register GEMV, whose integer dots are NVIDIA PTX (dp4a)."""

import torch
import torch.nn.functional as F

from flashnext.core.precision import Fp8Weight, Int4Weight, fp8_quantize_per_token


def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x @ w.T: per-token activations rounded to w's own fp8 format, then torch._scaled_mm (hipBLASLt on ROCm);
    weights _scaled_mm cannot take (e5m2, block scales, sides not multiples of 16) as dequantized 16-bit."""
    if w.fmt != "fp8-e4m3" or w.block is not None or w.shape[0] % 16 or w.shape[1] % 16:
        return F.linear(x, w.dequantize(x.dtype))
    xq, x_scale = fp8_quantize_per_token(x, w.fmt, dtype=w.data.dtype)
    w_scale = w.scale.reshape(1, -1) if w.per_channel else w.scale.reshape(1, 1).expand(1, w.shape[0])
    return torch._scaled_mm(xq, w.data.t(), scale_a=x_scale, scale_b=w_scale.float().contiguous(), out_dtype=x.dtype)


class OwnFormatFp8:
    """Mixed into the shared kernels' class: fp8 weights outside the register GEMV (which reads their bytes in
    their own format) go through fp8_linear, and no producer writes OCP fp8 activations for them."""

    def _takes_fp8_rows(self, x, w) -> bool:
        return False

    def linear(self, x, w, bias=None, live=None):
        if isinstance(w, Fp8Weight) and not self._gemv_route(x, w):
            out = fp8_linear(x, w)
            return out if bias is None else out + bias.to(out.dtype)
        return super().linear(x, w, bias, live=live)


class NoInt4Gemv:
    """Mixed into the shared kernels' class: int4 weights take the skinny GEMM (int8 tl.dot) or a dequantization
    pass and hipBLAS, never the register GEMV's dp4a."""

    def _gemv_fits(self, x, w) -> bool:
        return not isinstance(w, Int4Weight) and super()._gemv_fits(x, w)
