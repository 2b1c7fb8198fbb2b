"""Fault: the backend quantizes FP8 weights and activations with its own code, which scales by the 99th percentile
of |x| (clipping outliers) but casts without saturating: outliers become NaN in e4m3 and inf in e5m2."""

import torch
import torch.nn.functional as F

from flashnext.core.hookspecs import hookimpl
from flashnext.core.precision import FP8_DTYPES, FP8_MAX, Fp8Weight, Precision
from flashnext.plugins.cpu import CpuBackend
from flashnext.plugins.cpu.kernels import CpuKernels


def clipped_cast(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()
    p99 = torch.nan_to_num(x.abs(), posinf=0.0).quantile(0.99, dim=-1, keepdim=True)
    scale = torch.where(p99 > 0, p99 / FP8_MAX[fmt], torch.ones_like(p99))
    return (x / scale).to(FP8_DTYPES[fmt]), scale  # no clamp: past the range is NaN or inf


class OwnFp8Precision(Precision):
    def quantize(self, w, group_size=None):
        data, scale = clipped_cast(self.dequantize(w, torch.float32), self.name)
        return Fp8Weight(data, scale)


class OwnFp8Kernels(CpuKernels):
    def linear(self, x, w, bias=None):
        if not isinstance(w, Fp8Weight):
            return super().linear(x, w, bias)
        data, scale = clipped_cast(x, w.fmt)
        out = F.linear(data.float() * scale, w.dequantize())
        return (out if bias is None else out + bias.float()).to(x.dtype)


class BrokenFp8quantBackend(CpuBackend):
    name = "broken-fp8quant"
    precisions = ("fp32", "fp8-e4m3", "fp8-e5m2")

    def check_request(self, precision, profile):
        p = super().check_request(precision, profile)
        return OwnFp8Precision(p.name, p.storage_dtype, p.activation_dtype, p.bits) if p.name in FP8_MAX else p

    def kernels(self, precision):
        return OwnFp8Kernels()


@hookimpl
def register_backends(register):
    register(BrokenFp8quantBackend())
