"""Fault: one kernel raises (as a missing kernel build would); the report must name the op and the error."""

from flashnext.core.hookspecs import hookimpl
from flashnext.plugins.cpu import CpuBackend
from flashnext.plugins.cpu.kernels import CpuKernels


class CrashingKernels(CpuKernels):
    def silu_and_mul(self, x):
        raise RuntimeError(f"no silu_and_mul kernel built for shape {tuple(x.shape)}")


class BrokenCrashBackend(CpuBackend):
    name = "broken-crash"

    def kernels(self, precision):
        return CrashingKernels()


@hookimpl
def register_backends(register):
    register(BrokenCrashBackend())
