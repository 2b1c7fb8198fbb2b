"""RK3588's true INT4 path: librknnrt's matmul API (rknn_matmul_api.h) through ctypes, int4 x int4 -> int16.

The exported graphs carry int4 weights as their fp16 grid (the converter builds no w4 graph for rk3588); this is
the other route, where the NPU multiplies 4-bit numbers itself. Both operands are 4-bit, so activations are
quantized too (a scale a row here), and a group-quantized Int4Weight needs one product a group of columns
(its scales differ by group). `int4_linear` composes that; it is not wired into the graphs' runner.

Structs follow rknn_matmul_api.h of rknpu2 2.x (rknn_matmul_info with int16 layout fields and reserved[34]).
"""

import ctypes

import numpy as np

from flashnext.core.errors import UserError
from flashnext.core.precision import Int4Weight, unpack_int4

from .runtime import NpuRuntimeError

RKNN_INT4_MM_INT4_TO_INT16 = 10
RKNN_MAX_NAME_LEN, RKNN_MAX_DIMS = 256, 16
K_ALIGN, N_ALIGN = 32, 64  # RK3588 int4: K a multiple of 32, N of 64 (normal layout)


class MatmulTensorAttr(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char * RKNN_MAX_NAME_LEN),
        ("n_dims", ctypes.c_uint32),
        ("dims", ctypes.c_uint32 * RKNN_MAX_DIMS),
        ("size", ctypes.c_uint32),
        ("type", ctypes.c_int),
    ]


class MatmulIoAttr(ctypes.Structure):
    _fields_ = [("A", MatmulTensorAttr), ("B", MatmulTensorAttr), ("C", MatmulTensorAttr)]


class MatmulInfo(ctypes.Structure):
    _fields_ = [
        ("M", ctypes.c_int32),
        ("K", ctypes.c_int32),
        ("N", ctypes.c_int32),
        ("type", ctypes.c_int),
        ("B_layout", ctypes.c_int16),
        ("B_quant_type", ctypes.c_int16),
        ("AC_layout", ctypes.c_int16),
        ("AC_quant_type", ctypes.c_int16),
        ("iommu_domain_id", ctypes.c_int32),
        ("group_size", ctypes.c_int16),
        ("reserved", ctypes.c_int8 * 34),
    ]


class TensorMem(ctypes.Structure):
    _fields_ = [
        ("virt_addr", ctypes.c_void_p),
        ("phys_addr", ctypes.c_uint64),
        ("fd", ctypes.c_int32),
        ("offset", ctypes.c_int32),
        ("size", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("priv_data", ctypes.c_void_p),
    ]


def load_library(path: str = "librknnrt.so"):
    lib = ctypes.CDLL(path)
    lib.rknn_matmul_create.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(MatmulInfo),
        ctypes.POINTER(MatmulIoAttr),
    ]
    lib.rknn_create_mem.restype = ctypes.POINTER(TensorMem)
    lib.rknn_create_mem.argtypes = [ctypes.c_uint64, ctypes.c_uint32]
    lib.rknn_matmul_set_io_mem.argtypes = [ctypes.c_uint64, ctypes.POINTER(TensorMem), ctypes.POINTER(MatmulTensorAttr)]
    lib.rknn_matmul_run.argtypes = lib.rknn_matmul_destroy.argtypes = [ctypes.c_uint64]
    lib.rknn_matmul_set_core_mask.argtypes = [ctypes.c_uint64, ctypes.c_int]
    lib.rknn_destroy_mem.argtypes = [ctypes.c_uint64, ctypes.POINTER(TensorMem)]
    return lib


def pack_signed_int4(values: np.ndarray) -> np.ndarray:
    """int8 values -8..7, an even count a row -> bytes, element 2i in the low nibble (two's complement)."""
    nibbles = (values.astype(np.int16) & 0x0F).astype(np.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


class Int4Matmul:
    """One M x K x N product, C = A @ B, with A and B of signed int4 values and C int16, in normal layouts.
    Every call is checked: librknnrt returns negative codes, or a null pointer from rknn_create_mem."""

    def __init__(self, m: int, k: int, n: int, lib=None, core_mask: int = 0):
        if k % K_ALIGN or n % N_ALIGN:
            raise UserError(f"int4 matmul {m}x{k}x{n}: RK3588 needs K a multiple of {K_ALIGN} and N of {N_ALIGN}")
        self.lib, self.shape = lib or load_library(), (m, k, n)
        self.ctx = ctypes.c_uint64(0)
        info = MatmulInfo(M=m, K=k, N=n, type=RKNN_INT4_MM_INT4_TO_INT16)
        self.io = MatmulIoAttr()
        self._check(
            "rknn_matmul_create",
            self.lib.rknn_matmul_create(ctypes.pointer(self.ctx), ctypes.pointer(info), ctypes.pointer(self.io)),
        )
        if core_mask:
            self._check("rknn_matmul_set_core_mask", self.lib.rknn_matmul_set_core_mask(self.ctx.value, core_mask))
        self.mems = {}
        for name in "ABC":
            attr = getattr(self.io, name)
            mem = self.lib.rknn_create_mem(self.ctx.value, attr.size)
            if not mem:
                raise NpuRuntimeError(f"rknn_create_mem({attr.size}) for {name} of {self.shape} returned NULL")
            self.mems[name] = mem
            self._check(
                "rknn_matmul_set_io_mem", self.lib.rknn_matmul_set_io_mem(self.ctx.value, mem, ctypes.pointer(attr))
            )

    def _check(self, call: str, code: int) -> None:
        if code < 0:
            raise NpuRuntimeError(
                f"{call} failed with {code} for int4 matmul {self.shape}; check librknnrt.so "
                "(>= 2.0) and the rknpu driver"
            )

    def _write(self, name: str, data: bytes) -> None:
        mem = self.mems[name].contents
        if len(data) > mem.size:
            raise NpuRuntimeError(f"{name}: {len(data)} bytes do not fit the runtime's {mem.size}")
        ctypes.memmove(mem.virt_addr, data, len(data))

    def set_b(self, b: np.ndarray) -> None:
        """B [K, N] of int4 values -8..7 (the weights: set once)."""
        self._write("B", pack_signed_int4(np.asarray(b)).tobytes())

    def __call__(self, a: np.ndarray) -> np.ndarray:
        """A [M, K] of int4 values -8..7 -> C [M, N] int16."""
        m, _, n = self.shape
        self._write("A", pack_signed_int4(np.asarray(a)).tobytes())
        self._check("rknn_matmul_run", self.lib.rknn_matmul_run(self.ctx.value))
        out = (ctypes.c_int16 * (m * n)).from_address(self.mems["C"].contents.virt_addr)
        return np.frombuffer(out, np.int16).reshape(m, n).copy()

    def close(self) -> None:
        for mem in self.mems.values():
            self.lib.rknn_destroy_mem(self.ctx.value, mem)
        self.mems = {}
        self.lib.rknn_matmul_destroy(self.ctx.value)


def quantize_rows_int4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Activations [M, K] -> (int8 values -7..7, float32 scale a row)."""
    scale = np.abs(x).max(axis=1, keepdims=True) / 7.0
    scale[scale == 0] = 1.0
    return np.clip(np.rint(x / scale), -7, 7).astype(np.int8), scale.astype(np.float32)


def int4_linear(x: np.ndarray, weight: Int4Weight, matmuls) -> np.ndarray:
    """x [M, K] float -> x @ W^T with W a group-quantized Int4Weight, on int4 x int4 products: for each group g,
    sum_k xq * (q - 8) on the NPU, then scaled by the row's and the group's scales; an asymmetric weight's offsets
    (not -8 * scale) add their row sums. `matmuls(m, k, n)` gives an Int4Matmul-like object per group."""
    n, k = weight.shape
    g = weight.group_size
    q = unpack_int4(weight.packed).numpy().astype(np.int8).reshape(n, k // g, g) - 8  # signed, -8..7
    scales, offsets = weight.scales.numpy(), weight.offsets.numpy()
    extra = offsets + 8.0 * scales  # 0 for symmetric weights: value = (q - 8) * scale + extra
    xq, xs = quantize_rows_int4(np.asarray(x, np.float32))
    y = np.zeros((x.shape[0], n), np.float32)
    for group in range(k // g):
        mm = matmuls(x.shape[0], g, n)
        mm.set_b(np.ascontiguousarray(q[:, group, :].T))
        a = xq[:, group * g : (group + 1) * g]
        y += mm(a).astype(np.float32) * xs * scales[:, group]
        if np.any(extra[:, group]):
            y += (a.astype(np.float32).sum(1, keepdims=True) * xs) * extra[:, group]
    return y
