"""Triton building blocks every CUDA kernel family shares: programmatic dependent launch, an L2 prefetch, and dots
that stay exact under the CPU interpreter the tests run."""

import os

import torch
import triton
import triton.language as tl

try:  # grid dependency control (programmatic dependent launch), Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: kernels launch plainly
    gdc_launch_dependents = gdc_wait = None


# Triton's CPU interpreter (the CI tests): it mis-multiplies bf16 dots (3.9), so dots run in fp32 under it, and it
# runs no inline assembly, so dp4a is spelled out there.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def pdl_supported() -> bool:
    """Programmatic dependent launch: Hopper or newer, a Triton that has it, not the CPU interpreter."""
    if gdc_wait is None or os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= (9, 0)


@triton.jit
def _after_producer(PDL: tl.constexpr):
    """Under programmatic dependent launch a kernel starts while the previous one still runs: wait here until its
    writes are visible, then let the next kernel's programs start too. Nothing may be written or read from an
    earlier kernel's output before this point; constant data (weights) may be, and should be: that is the gain."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ptrs. Nothing waits on a prefetch, so a kernel can issue its reads of data
    that no running kernel writes before its programmatic-dependent-launch wait, and find them in L2 after it."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _dot(a, b, acc=None):
    if _INTERPRETED:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif a.dtype == tl.float32:
        # fp32 means fp32: tl.dot would otherwise round fp32 inputs to TF32 (NMSE ~1e-7 in conformance)
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out
