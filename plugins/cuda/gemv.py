"""The register GEMV for few-row projections: rmsnorm fused into its prologue and SiLU-and-mul into its epilogue,
for 16-bit, fp8 and int4 weights (int4 through int8 dots), and PackedX, the output it hands the int4 GEMV after it
already rounded."""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .primitives import _INTERPRETED, _after_producer, _pow2
from .quant import _int8_blocks


@triton.jit
def _load_rows(
    w_ptr,
    scales_ptr,
    offsets_ptr,
    n,
    n_ok,
    K,
    k0,
    WKIND: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """BLOCK_N weight rows at n, columns k0 .. k0 + BLOCK_K (those < K), as stored, with their scales and offsets
    (unused ones are 0): (w, s, o). An int4 piece starts and ends on group boundaries."""
    if WKIND == 2:  # int32 words of 8 nibbles (byte j: columns 2j, 2j + 1)
        # Words a row: K // 8 written as a multiple of 4 (int4 rows here hold whole X_BLOCKs of 32 columns), so
        # that Triton sees rows start 16 bytes apart and reads four words a load; from K // 8 it could prove two
        # words at most, one where K is not a multiple of 16 (benchmarks/ptx_census.py).
        words = (K // X_BLOCK) * (X_BLOCK // 8)
        i = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        w = tl.load(
            w_ptr.to(tl.pointer_type(tl.int32)) + n[:, None] * words + i[None, :],
            mask=n_ok[:, None] & (i < words)[None, :],
            other=0,
        )
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        g_mask = n_ok[:, None] & (g < K // GROUP)[None, :]
        s = tl.load(scales_ptr + n[:, None] * (K // GROUP) + g[None, :], mask=g_mask, other=0.0)
        o = tl.load(offsets_ptr + n[:, None] * (K // GROUP) + g[None, :], mask=g_mask, other=0.0)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
        s = tl.load(scales_ptr + n, mask=n_ok, other=0.0) if WKIND == 1 else 0.0
        o = 0.0
    return w, s, o


# Int4 rows meet x quantized to int8 in blocks of this many columns (llama.cpp's q8_1 block), so that the nibbles
# multiply integers four at a time (dp4a) and only each block's sum is scaled.
X_BLOCK = tl.constexpr(32)


@triton.jit
def _dp4a(a, b, c):
    """c + the dot of a's four unsigned bytes with b's four signed ones, in int32 lanes."""
    if _INTERPRETED:
        out = c
        for i in tl.static_range(4):
            out += ((a >> (8 * i)) & 0xFF) * ((b << (24 - 8 * i)) >> 24)
    else:
        out = tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    return out


@triton.jit
def _x_int8(xf, BLOCK_K: tl.constexpr, XB: tl.constexpr):
    """x [BLOCK_K] float32 as int8 in blocks of XB columns, scaled to each block's largest magnitude: (even-column
    bytes, odd-column bytes) packed four to an int32 to meet the low / high nibbles of a weight word, the block
    scales and the blocks' integer sums (as floats)."""
    xi, scale, sums = _int8_blocks(tl.reshape(xf, (BLOCK_K // XB, XB)))
    even, odd = tl.split(tl.reshape(xi, (BLOCK_K // 8, 4, 2)))
    shift = (tl.arange(0, 4) * 8)[None, :]  # disjoint bytes: the sums are ORs
    return tl.sum((even & 0xFF) << shift, axis=1), tl.sum((odd & 0xFF) << shift, axis=1), scale, sums


@triton.jit
def _int4_row_dots(w, s, o, xq, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, XB: tl.constexpr):
    """W · x for int4 rows (int32 words) and x from _x_int8 (blocks of XB columns) or _packed_x. Exact integer
    sums a block, then sum((q s + o) x) = x_scale (s sum(q xi) + o sum(xi)) a block: about a fifth of the
    instructions of meeting every nibble with a float (a 4-row program: 2 words, 4 dp4a, 3 masks per 16 weights)."""
    x_even, x_odd, x_scale, x_sums = xq
    dots = _dp4a(
        (w >> 4) & 0x0F0F0F0F,
        tl.broadcast_to(x_odd[None, :], w.shape),
        _dp4a(w & 0x0F0F0F0F, tl.broadcast_to(x_even[None, :], w.shape), tl.zeros(w.shape, tl.int32)),
    )
    PER_GROUP: tl.constexpr = GROUP // XB
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    blocks = tl.reshape(
        tl.sum(tl.reshape(dots, (BLOCK_N, BLOCK_K // XB, XB // 8)), axis=2), (BLOCK_N, GROUPS, PER_GROUP)
    ).to(tl.float32)
    x_sums = tl.reshape(x_sums, (GROUPS, PER_GROUP))[None, :, :]
    x_scale = tl.reshape(x_scale, (GROUPS, PER_GROUP))[None, :, :]
    return tl.sum(tl.sum(x_scale * (s[:, :, None] * blocks + o[:, :, None] * x_sums), axis=2), axis=1)


@triton.jit
def _row_dots(
    w, s, o, x, WKIND: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, XB: tl.constexpr
):
    """W · x for the rows _load_rows returned: x [BLOCK_K] float32 (zero past K), or for int4 rows _x_int8 of it
    (blocks of XB columns) or _packed_x."""
    if WKIND == 2:
        acc = _int4_row_dots(w, s, o, x, GROUP, BLOCK_N, BLOCK_K, XB)
    else:
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if WKIND == 1:
            acc = acc * s
    return acc


@triton.jit
def _x_piece(x_ptr, res_ptr, res_out_ptr, row, ROWS, K, k, pid, HAS_RES: tl.constexpr, dtype: tl.constexpr):
    """x[row] (+ res[row]) at columns k, in float32 (0 past K); the n-block 0 programs store the sum as the new
    residual."""
    k_ok = (k < K) & (k * 0 + row < ROWS)  # masks as tensors: the interpreter rejects scalar conditions
    x = tl.load(x_ptr + row * K + k, mask=k_ok, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * K + k, mask=k_ok, other=0.0).to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * K + k, x, mask=k_ok & (k * 0 + pid == 0))
    return x.to(tl.float32)


# A GEMV can hand the int4 GEMV after it x already rounded (PackedX): a row of K columns is [even-column words K/8 |
# odd-column words K/8 | block scales K/16 | block integer sums K/16 | sums of squares, a producer program each],
# blocks of PACKED_BLOCK columns (one producer program holds whole blocks), so the consumer's programs skip the
# norm's reduction and the rounding that each of them would otherwise repeat over the whole row.
PACKED_BLOCK = tl.constexpr(16)


@triton.jit
def _packed_x(row_ptr, K, k0, row, ROWS, BLOCK_K: tl.constexpr):
    """_x_int8's four parts for columns k0 .. k0 + BLOCK_K of the PackedX row at row_ptr (float32), 0 past K."""
    i = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    b = k0 // PACKED_BLOCK + tl.arange(0, BLOCK_K // PACKED_BLOCK)
    i_ok, b_ok = (i < K // 8) & (i * 0 + row < ROWS), (b < K // PACKED_BLOCK) & (b * 0 + row < ROWS)
    words = row_ptr.to(tl.pointer_type(tl.int32))
    return (
        tl.load(words + i, mask=i_ok, other=0),
        tl.load(words + K // 8 + i, mask=i_ok, other=0),
        tl.load(row_ptr + K // 4 + b, mask=b_ok, other=0.0),
        tl.load(row_ptr + K // 4 + K // PACKED_BLOCK + b, mask=b_ok, other=0.0),
    )


@triton.jit
def _packed_rms(row_ptr, K, parts, eps, row, ROWS, P_BLOCK: tl.constexpr):
    """1 / rms of the row whose PackedX is at row_ptr, from its producer programs' sums of squares."""
    p = tl.arange(0, P_BLOCK)
    sq = tl.load(row_ptr + K // 4 + K // 8 + p, mask=(p < parts) & (p * 0 + row < ROWS), other=0.0)
    return tl.rsqrt(tl.sum(sq, axis=0) / K + eps)


@triton.jit
def _store_packed(
    acc,
    out_ptr,
    res_ptr,
    res_out_ptr,
    nwq,
    row,
    ROWS,
    N_OUT,
    n,
    n_ok,
    pid,
    QRES: tl.constexpr,
    QNORM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    Q_PBLOCK: tl.constexpr,
):
    """Program pid's outputs acc [BLOCK_N] of a row as the PackedX of the next projection's input: QRES adds the
    residual (and stores the sum as the new residual), QNORM stores its sum of squares and multiplies by the next
    norm's weight nwq (the next GEMV applies 1 / rms to its dots: rounding in blocks does not see a row's scale)."""
    ok = n_ok & (n * 0 + row < ROWS)
    y = acc.to(tl.float32)
    if QRES:
        y = (y + tl.load(res_ptr + row * N_OUT + n, mask=ok, other=0.0).to(tl.float32)).to(acc.dtype)
        tl.store(res_out_ptr + row * N_OUT + n, y, mask=ok)
        y = y.to(tl.float32)
    row_ptr = out_ptr + row * (N_OUT // 4 + N_OUT // 8 + Q_PBLOCK)
    if QNORM:
        one = tl.arange(0, 1)
        tl.store(
            row_ptr + N_OUT // 4 + N_OUT // 8 + pid + one,
            tl.sum(y * y, axis=0) + tl.zeros([1], tl.float32),
            mask=one * 0 + row < ROWS,
        )
        y = y * nwq
    even, odd, scale, sums = _x_int8(y, BLOCK_N, PACKED_BLOCK)
    i = pid * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    b = pid * (BLOCK_N // PACKED_BLOCK) + tl.arange(0, BLOCK_N // PACKED_BLOCK)
    i_ok, b_ok = (i < N_OUT // 8) & (i * 0 + row < ROWS), (b < N_OUT // PACKED_BLOCK) & (b * 0 + row < ROWS)
    words = row_ptr.to(tl.pointer_type(tl.int32))
    tl.store(words + i, even, mask=i_ok)
    tl.store(words + N_OUT // 8 + i, odd, mask=i_ok)
    tl.store(row_ptr + N_OUT // 4 + b, scale, mask=b_ok)
    tl.store(row_ptr + N_OUT // 4 + N_OUT // PACKED_BLOCK + b, sums, mask=b_ok)


@triton.jit
def _norm_gemv_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    nw_ptr,
    w_ptr,
    scales_ptr,
    offsets_ptr,
    out_ptr,
    live_ptr,
    ROWS,
    K,
    N_OUT,
    eps,
    X_PARTS,
    HAS_NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    SILU: tl.constexpr,
    WKIND: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    LIVE: tl.constexpr,
    PDL: tl.constexpr,
    PACKED: tl.constexpr,
    P_BLOCK: tl.constexpr,
    QOUT: tl.constexpr,
    QRES: tl.constexpr,
    QNORM: tl.constexpr,
    Q_PBLOCK: tl.constexpr,
):
    """out[row] = W · rmsnorm(x[row] (+ res[row])), the whole row in registers; SILU folds silu(gate) * up in.

    Program (n block, row block) holds BLOCK_N rows of W and the norm weight (read before the wait for the
    producer of x) and applies them to ROW_BLOCK rows of x, unrolled and independent: every row runs the same
    instructions a one-row call runs, so its result is bit-equal whatever ROWS and ROW_BLOCK are (a speculative
    verify step reproduces decode).
    The row is held as columns 0 .. BLOCK_K and, when BLOCK_KB > 0, BLOCK_K .. BLOCK_K + BLOCK_KB (see
    gemv_k_pieces). With SILU the weight is gate rows then up rows ([2 * N_OUT, K]) and out is [rows, N_OUT]. The
    n-block 0 programs write the new residual; the others only read the old one, so the output buffer must differ
    from the input. Weights are read as WKIND says (see _load_rows); int4 rows meet x as int8 blocks (_x_int8),
    as llama.cpp's quantized GEMVs do: per-row numerics, so row invariance holds for them as for the others.
    PACKED: x is a PackedX (int4 W; X_PARTS sums of squares, P_BLOCK a power of two >= X_PARTS): its rounding and
    with HAS_NORM the norm's weight and residual are done, 1 / rms is applied to the dots. QOUT: out is the PackedX
    of the next int4 GEMV's input (_store_packed; QRES: res_ptr / res_out_ptr are the residual of the outputs,
    QNORM: nw_ptr the next norm's weight, Q_PBLOCK the next call's P_BLOCK).
    LIVE (ROW_BLOCK 1): a row whose live_ptr entry (its context length) is 0, a verify step's row past its drafts
    or a bucket's padding row, is not computed: nothing reads it, and its output and residual rows are left as
    they were, so a step costs the rows it really has.
    """
    pid, first_row = tl.program_id(0), tl.program_id(1) * ROW_BLOCK
    TWO: tl.constexpr = BLOCK_KB > 0
    XB: tl.constexpr = PACKED_BLOCK if PACKED else X_BLOCK
    NORM_X: tl.constexpr = HAS_NORM and not PACKED
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N_OUT
    if LIVE:  # gates the rows' work only: the weight reads below must not wait for this load
        go = tl.load(live_ptr + first_row) != 0
    else:
        go = True
    w, s, o = _load_rows(w_ptr, scales_ptr, offsets_ptr, n, n_ok, K, 0, WKIND, GROUP, BLOCK_N, BLOCK_K)
    if TWO:
        wb, sb, ob = _load_rows(w_ptr, scales_ptr, offsets_ptr, n, n_ok, K, BLOCK_K, WKIND, GROUP, BLOCK_N, BLOCK_KB)
    if SILU:
        up_n = n + N_OUT
        w_up, s_up, o_up = _load_rows(w_ptr, scales_ptr, offsets_ptr, up_n, n_ok, K, 0, WKIND, GROUP, BLOCK_N, BLOCK_K)
        if TWO:
            w_upb, s_upb, o_upb = _load_rows(
                w_ptr, scales_ptr, offsets_ptr, up_n, n_ok, K, BLOCK_K, WKIND, GROUP, BLOCK_N, BLOCK_KB
            )
    k = tl.arange(0, BLOCK_K)
    if TWO:
        kb = BLOCK_K + tl.arange(0, BLOCK_KB)
    if NORM_X:
        nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        if TWO:
            nwb = tl.load(nw_ptr + kb, mask=kb < K, other=0.0).to(tl.float32)
    if QNORM:
        nwq = tl.load(nw_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    else:
        nwq = 1.0
    _after_producer(PDL)
    dtype = res_out_ptr.dtype.element_ty if QOUT else out_ptr.dtype.element_ty
    if go:
        for i in tl.static_range(ROW_BLOCK):
            row = first_row + i
            if PACKED:
                row_ptr = x_ptr + row * (K // 4 + K // 8 + P_BLOCK)
                xf = _packed_x(row_ptr, K, 0, row, ROWS, BLOCK_K)
                if TWO:
                    xfb = _packed_x(row_ptr, K, BLOCK_K, row, ROWS, BLOCK_KB)
                rms = _packed_rms(row_ptr, K, X_PARTS, eps, row, ROWS, P_BLOCK) if HAS_NORM else 1.0
            else:
                xf = _x_piece(x_ptr, res_ptr, res_out_ptr, row, ROWS, K, k, pid, HAS_RES, dtype)
                if TWO:
                    xfb = _x_piece(x_ptr, res_ptr, res_out_ptr, row, ROWS, K, kb, pid, HAS_RES, dtype)
                if HAS_NORM:
                    sum_sq = tl.sum(xf * xf, axis=0)
                    if TWO:
                        sum_sq += tl.sum(xfb * xfb, axis=0)
                    rms = tl.rsqrt(sum_sq / K + eps)
                    xf = (xf * rms * nw).to(dtype).to(tl.float32)
                    if TWO:
                        xfb = (xfb * rms * nwb).to(dtype).to(tl.float32)
                if WKIND == 2:  # rounded to int8 once a row piece, for gate and up alike
                    xf = _x_int8(xf, BLOCK_K, XB)
            acc = _row_dots(w, s, o, xf, WKIND, GROUP, BLOCK_N, BLOCK_K, XB)
            if TWO:
                if WKIND == 2 and not PACKED:
                    xfb = _x_int8(xfb, BLOCK_KB, XB)
                acc += _row_dots(wb, sb, ob, xfb, WKIND, GROUP, BLOCK_N, BLOCK_KB, XB)
            if PACKED and HAS_NORM:
                acc = acc * rms
            acc = acc.to(dtype)
            if SILU:
                up = _row_dots(w_up, s_up, o_up, xf, WKIND, GROUP, BLOCK_N, BLOCK_K, XB)
                if TWO:
                    up += _row_dots(w_upb, s_upb, o_upb, xfb, WKIND, GROUP, BLOCK_N, BLOCK_KB, XB)
                if PACKED and HAS_NORM:
                    up = up * rms
                gate = acc.to(tl.float32)
                acc = ((gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)
            if QOUT:
                _store_packed(
                    acc,
                    out_ptr,
                    res_ptr,
                    res_out_ptr,
                    nwq,
                    row,
                    ROWS,
                    N_OUT,
                    n,
                    n_ok,
                    pid,
                    QRES,
                    QNORM,
                    BLOCK_N,
                    Q_PBLOCK,
                )
            else:
                tl.store(out_ptr + row * N_OUT + n, acc, mask=n_ok & (n * 0 + row < ROWS))


@dataclass
class PackedX:
    """A GEMV's output as the int4 GEMV after it takes it (_store_packed; layout at PACKED_BLOCK): data [rows,
    K / 4 + K / 8 + pow2(parts)] float32, parts the producer programs' sums of squares (0: no norm between)."""

    data: torch.Tensor
    k: int
    parts: int
    dtype: torch.dtype  # the activations' own 16-bit dtype: what the projection writes

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.k))

    @property
    def device(self) -> torch.device:
        return self.data.device


def _parts_block(parts: int) -> int:
    """The room a PackedX row keeps for its producer's sums of squares (the kernels' P_BLOCK / Q_PBLOCK)."""
    return _pow2(max(parts, 1))


def _empty_packed_x(rows: int, k: int, parts: int, dtype: torch.dtype, device) -> PackedX:
    return PackedX(
        torch.empty(rows, k // 4 + k // 8 + _parts_block(parts), dtype=torch.float32, device=device), k, parts, dtype
    )
