"""A third-party flashnext backend: the CPU backend's kernels with one override (its own rmsnorm)."""

import torch

from flashnext.core.backend import API_VERSION, Probe
from flashnext.core.hookspecs import hookimpl
from flashnext.plugins.cpu import CpuBackend
from flashnext.plugins.cpu.kernels import CpuKernels


class ToyKernels(CpuKernels):
    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Another formula than the CPU backend's fused op: the mean square from the 2-norm. Statistics stay in
        # fp32 whatever the activation dtype, since the conformance bounds allow one rounding, at the end.
        xf = x.float()
        mean_square = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square() / x.shape[-1]
        return (xf * torch.rsqrt(mean_square + eps) * weight.float()).to(x.dtype)


class ToyBackend(CpuBackend):
    name = "toy"
    api_version = API_VERSION  # the plugin contract it was written for; it inherits the CPU backend's capabilities

    def probe(self) -> Probe:
        # Below the CPU backend's score: an example must never win `--backend auto`.
        return Probe(True, 0.5, "example backend: CPU kernels with its own rmsnorm", {})

    def kernels(self, precision):
        return ToyKernels()


@hookimpl
def register_backends(register):
    register(ToyBackend())
