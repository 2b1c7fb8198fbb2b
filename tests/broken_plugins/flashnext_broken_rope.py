"""Fault: rope rotates every token by the angle of the next position (an off-by-one in the position index)."""

from flashnext.core.hookspecs import hookimpl
from flashnext.plugins.cpu import CpuBackend
from flashnext.plugins.cpu.kernels import CpuKernels


class OffByOneRopeKernels(CpuKernels):
    def rope(self, q, k, positions, cos_sin):
        return super().rope(q, k, positions + 1, cos_sin)


class BrokenRopeBackend(CpuBackend):
    name = "broken-rope"

    def kernels(self, precision):
        return OffByOneRopeKernels()


@hookimpl
def register_backends(register):
    register(BrokenRopeBackend())
