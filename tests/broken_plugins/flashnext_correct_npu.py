"""Not broken: an NPU-like backend that runs bf16 and int4 only (no fp32), reusing the CPU backend's kernels
unchanged. The suite must pass it: rounding at bf16 is not a fault."""

import torch

from flashnext.core.backend import Probe
from flashnext.core.hookspecs import hookimpl
from flashnext.plugins.cpu import CpuBackend


class CorrectNpuBackend(CpuBackend):
    name = "correct-npu"
    precisions = ("bf16", "int4")
    default_precision = "bf16"
    features = {"chunked_prefill": True, "prefix_caching": True, "spec_decode": True}

    def probe(self):
        return Probe(True, 0.2, "bf16 and int4 only, the CPU's kernels", {})

    def activation_dtype(self, precision):
        return torch.bfloat16

    def head_dtype(self, precision):
        return torch.bfloat16

    def preferred_precision(self, weights):
        return self.default_precision


@hookimpl
def register_backends(register):
    register(CorrectNpuBackend())
