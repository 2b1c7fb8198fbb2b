"""Fault: attention's softmax temperature is off by 0.5% (the score scale is multiplied by 1.005)."""

from flashnext.core.hookspecs import hookimpl
from flashnext.plugins.cpu import CpuBackend
from flashnext.plugins.cpu.kernels import CpuKernels


class WarmSoftmaxKernels(CpuKernels):
    def attention(self, q, k_cache, v_cache, meta, scale):
        return super().attention(q, k_cache, v_cache, meta, scale * 1.005)


class BrokenSoftmaxBackend(CpuBackend):
    name = "broken-softmax"

    def kernels(self, precision):
        return WarmSoftmaxKernels()


@hookimpl
def register_backends(register):
    register(BrokenSoftmaxBackend())
