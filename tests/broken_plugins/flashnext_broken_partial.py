"""Fault: attention's launch grid covers whole tiles of 8 query rows only, so the ragged tail is never written."""

import torch

from flashnext.core.hookspecs import hookimpl
from flashnext.plugins.cpu import CpuBackend
from flashnext.plugins.cpu.kernels import CpuKernels

TILE = 8


class PartialAttentionKernels(CpuKernels):
    def attention(self, q, k_cache, v_cache, meta, scale):
        full = super().attention(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        covered = q.shape[0] // TILE * TILE  # should round up
        out[:covered] = full[:covered]
        return out


class BrokenPartialBackend(CpuBackend):
    name = "broken-partial"

    def kernels(self, precision):
        return PartialAttentionKernels()


@hookimpl
def register_backends(register):
    register(BrokenPartialBackend())
