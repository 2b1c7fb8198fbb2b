"""Fault: attention drops the split-KV partitions past 2048 keys, so contexts longer than 2k see only their
first 2048 positions (short contexts are exact)."""

from dataclasses import replace

from flashnext.core.hookspecs import hookimpl
from flashnext.plugins.cpu import CpuBackend
from flashnext.plugins.cpu.kernels import CpuKernels

PARTITION_LIMIT = 2048


class ShortSightedKernels(CpuKernels):
    def attention(self, q, k_cache, v_cache, meta, scale):
        seen = tuple(min(c, PARTITION_LIMIT) for c in meta.context_lens_host)
        return super().attention(q, k_cache, v_cache, replace(meta, context_lens_host=seen), scale)


class BrokenLongctxBackend(CpuBackend):
    name = "broken-longctx"

    def kernels(self, precision):
        return ShortSightedKernels()


@hookimpl
def register_backends(register):
    register(BrokenLongctxBackend())
