"""The INT4 matmul wrapper over librknnrt's C API, against a stand-in library that keeps the API's structs,
pointers and return codes and multiplies in numpy."""

import ctypes

import numpy as np
import pytest
import torch

from flashnext.core.errors import UserError
from flashnext.core.precision import int4_quantize
from flashnext.plugins.rknpu.matmul import (
    RKNN_INT4_MM_INT4_TO_INT16,
    Int4Matmul,
    MatmulInfo,
    TensorMem,
    int4_linear,
    quantize_rows_int4,
)
from flashnext.plugins.rknpu.runtime import NpuRuntimeError


def unpack_signed(raw: bytes, count: int) -> np.ndarray:
    b = np.frombuffer(raw, np.uint8)
    nib = np.stack([b & 0x0F, b >> 4], -1).reshape(-1)[:count].astype(np.int16)
    return np.where(nib > 7, nib - 16, nib)


class FakeRknnrt:
    """librknnrt's matmul entry points as the C API spells them (ctx by pointer, NULL or negative on failure)."""

    def __init__(self, fail: str = ""):
        self.fail, self.keep, self.io, self.bound, self.calls = fail, [], None, {}, []

    def rknn_matmul_create(self, ctx, info, io):
        self.calls.append("create")
        i = info.contents
        if self.fail == "create" or i.type != RKNN_INT4_MM_INT4_TO_INT16:
            return -1
        self.shape, self.io = (i.M, i.K, i.N), io.contents
        for name, size in (("A", i.M * i.K // 2), ("B", i.K * i.N // 2), ("C", i.M * i.N * 2)):
            attr = getattr(self.io, name)
            attr.name, attr.size = name.encode(), size
        ctx.contents.value = 7
        return 0

    def rknn_create_mem(self, ctx, size):
        if self.fail == "mem":
            return ctypes.POINTER(TensorMem)()
        buf = ctypes.create_string_buffer(size)
        mem = TensorMem(virt_addr=ctypes.addressof(buf), size=size)
        self.keep += [buf, mem]
        return ctypes.pointer(mem)

    def rknn_matmul_set_io_mem(self, ctx, mem, attr):
        self.bound[attr.contents.name.decode()] = mem.contents
        return 0

    def rknn_matmul_set_core_mask(self, ctx, mask):
        self.calls.append(("core_mask", mask))
        return 0

    def rknn_matmul_run(self, ctx):
        if self.fail == "run":
            return -5
        m, k, n = self.shape
        read = lambda name, size: ctypes.string_at(self.bound[name].virt_addr, size)  # noqa: E731
        a = unpack_signed(read("A", m * k // 2), m * k).reshape(m, k)
        b = unpack_signed(read("B", k * n // 2), k * n).reshape(k, n)
        c = (a.astype(np.int32) @ b.astype(np.int32)).astype(np.int16)
        ctypes.memmove(self.bound["C"].virt_addr, c.tobytes(), c.nbytes)
        return 0

    def rknn_destroy_mem(self, ctx, mem):
        self.calls.append("destroy_mem")

    def rknn_matmul_destroy(self, ctx):
        self.calls.append("destroy")


def test_info_struct_matches_the_header_layout():
    assert ctypes.sizeof(MatmulInfo) == 4 * 4 + 2 * 4 + 4 + 2 + 34 == 64
    assert MatmulInfo.group_size.offset == 28 and MatmulInfo.reserved.offset == 30


def test_int4_product_round_trips_through_the_runtime_buffers():
    lib = FakeRknnrt()
    rng = np.random.default_rng(0)
    a, b = rng.integers(-8, 8, (4, 64)), rng.integers(-8, 8, (64, 128))
    mm = Int4Matmul(4, 64, 128, lib, core_mask=7)
    mm.set_b(b)
    assert np.array_equal(mm(a), a @ b)
    mm.close()
    assert ("core_mask", 7) in lib.calls and lib.calls[-1] == "destroy" and lib.calls.count("destroy_mem") == 3


@pytest.mark.parametrize(
    "fail, message",
    [
        ("create", "rknn_matmul_create failed with -1"),
        ("mem", "rknn_create_mem.*returned NULL"),
        ("run", "rknn_matmul_run failed with -5"),
    ],
)
def test_each_runtime_failure_is_one_clear_error(fail, message):
    with pytest.raises(NpuRuntimeError, match=message):
        mm = Int4Matmul(4, 64, 64, FakeRknnrt(fail))
        mm(np.zeros((4, 64), np.int8))


def test_unaligned_shapes_are_refused():
    with pytest.raises(UserError, match="K a multiple of 32 and N of 64"):
        Int4Matmul(1, 48, 64, FakeRknnrt())


@pytest.mark.parametrize("symmetric", [True, False])
def test_group_quantized_linear_matches_the_dequantized_weight(symmetric):
    """int4 x int4 products a group, rescaled: equal to the int4-rounded activations times the Int4Weight's own
    values (the core's numerics for the weight; only the activations' rounding is added)."""
    torch.manual_seed(0)
    w = int4_quantize(torch.randn(64, 96), group_size=32, symmetric=symmetric)
    x = np.random.default_rng(1).standard_normal((3, 96)).astype(np.float32)
    got = int4_linear(x, w, lambda m, k, n: Int4Matmul(m, k, n, FakeRknnrt()))
    xq, xs = quantize_rows_int4(x)
    want = (xq * xs) @ w.dequantize(torch.float32).numpy().T
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5)
