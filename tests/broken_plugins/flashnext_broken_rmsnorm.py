"""Fault: rmsnorm's output is 0.5% too large (a normalization constant off by 0.5%)."""

from flashnext.core.hookspecs import hookimpl
from flashnext.plugins.cpu import CpuBackend
from flashnext.plugins.cpu.kernels import CpuKernels


class ScaledRmsnormKernels(CpuKernels):
    def rmsnorm(self, x, weight, eps):
        return (super().rmsnorm(x, weight, eps).float() * 1.005).to(x.dtype)


class BrokenRmsnormBackend(CpuBackend):
    name = "broken-rmsnorm"

    def kernels(self, precision):
        return ScaledRmsnormKernels()


@hookimpl
def register_backends(register):
    register(BrokenRmsnormBackend())
