"""Fault: FP8 linears cast activations to FP8 without a scale, so anything beyond the format's range becomes inf."""

import torch.nn.functional as F

from flashnext.core.hookspecs import hookimpl
from flashnext.core.precision import Fp8Weight
from flashnext.plugins.cpu import CpuBackend
from flashnext.plugins.cpu.kernels import CpuKernels


class UnscaledFp8Kernels(CpuKernels):
    def linear(self, x, w, bias=None):
        if not isinstance(w, Fp8Weight):
            return super().linear(x, w, bias)
        x8 = x.to(w.data.dtype)  # e5m2 has inf: |x| > 57344 overflows instead of saturating
        out = F.linear(x8.float(), w.data.float()) * w.scale.float().reshape(1, -1)
        return (out if bias is None else out + bias.float()).to(x.dtype)


class BrokenFp8Backend(CpuBackend):
    name = "broken-fp8"
    precisions = ("fp32", "fp8-e5m2")

    def kernels(self, precision):
        return UnscaledFp8Kernels()


@hookimpl
def register_backends(register):
    register(BrokenFp8Backend())
