"""Fault: declares int4, reports int4, but keeps the weights in fp32 and computes with them."""

import torch

from flashnext.core.hookspecs import hookimpl
from flashnext.core.precision import Precision
from flashnext.plugins.cpu import CpuBackend


class SilentFp32Precision(Precision):
    def quantize(self, w, group_size=128):
        return self.dequantize(w, torch.float32)


class BrokenInt4Backend(CpuBackend):
    name = "broken-int4"
    precisions = ("fp32", "int4")

    def check_request(self, precision, profile):
        p = super().check_request(precision, profile)
        return SilentFp32Precision("int4", torch.float32, torch.float32, 4) if p.name == "int4" else p


@hookimpl
def register_backends(register):
    register(BrokenInt4Backend())
