"""Fault: linear computes the rows of its second 64-row tile from bf16-rounded inputs (a tile path with the wrong
dtype). The op cases never pass 64 rows; a batched prefill does, so the engine invariants must catch it and name
the first linear of layer 0, where batched and alone runs part."""

import torch

from flashnext.core.hookspecs import hookimpl
from flashnext.plugins.cpu import CpuBackend
from flashnext.plugins.cpu.kernels import CpuKernels

TILE = 64


class SecondTileKernels(CpuKernels):
    def linear(self, x, w, bias=None):
        out = super().linear(x, w, bias)
        if x.shape[0] > TILE:
            rounded = x[TILE:].to(torch.bfloat16).to(x.dtype)
            out = torch.cat([out[:TILE], super().linear(rounded, w, bias)])
        return out


class BrokenTileBackend(CpuBackend):
    name = "broken-tile"

    def kernels(self, precision):
        return SecondTileKernels()


@hookimpl
def register_backends(register):
    register(BrokenTileBackend())
