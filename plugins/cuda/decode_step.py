"""Decode-step bookkeeping on the device, so captured graph replays feed themselves: argmax in chunks, each row's
next slot and context length, and the advance of ids and positions."""

import torch
import triton
import triton.language as tl

from .primitives import _after_producer


@triton.jit
def _argmax_key(value, index):
    """(value, index) packed in an int64 ordered by value, then by the lower index (torch.argmax returns the first
    of equal maxima): the float's bits made monotonic as an unsigned 32-bit number, above 31 bits of
    2^31 - 1 - index. Positive, so 0 is below every key."""
    bits = value.to(tl.int32, bitcast=True)
    monotonic = tl.where(bits < 0, ~bits, bits | -2147483648).to(tl.int64) & 0xFFFFFFFF
    return (monotonic << 31) | (2147483647 - index.to(tl.int64))


@triton.jit
def _argmax_token(keys):
    """The token of the best of argmax_keys' keys along axis 1 (the index _argmax_key packed)."""
    return 2147483647 - (tl.max(keys, axis=1) & 2147483647)


@triton.jit
def _argmax_chunks_kernel(x_ptr, keys_ptr, N, CHUNK, CHUNKS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """First half of a greedy step's argmax: the best key of each chunk of each row (decode_advance takes the
    rest). Many programs where torch's argmax gives a vocabulary-sized row to one."""
    _after_producer(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    j = tl.arange(0, BLOCK)
    i = chunk * CHUNK + j
    ok = (j < CHUNK) & (i < N)
    value = tl.load(x_ptr + row * N + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(keys_ptr + row * CHUNKS + chunk, tl.max(tl.where(ok, _argmax_key(value, i), 0), axis=0))


@triton.jit
def _decode_inputs_kernel(
    pos_ptr,
    live_ptr,
    tables_ptr,
    slot_ptr,
    ctx_ptr,
    rows,
    width,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    _after_producer(PDL)
    r = tl.arange(0, BLOCK)
    m = r < rows
    pos = tl.load(pos_ptr + r, mask=m, other=0)
    live = tl.load(live_ptr + r, mask=m, other=0) != 0
    block = tl.load(tables_ptr + r * width + tl.minimum(pos // BLOCK_SIZE, width - 1), mask=m & live, other=0)
    tl.store(slot_ptr + r, tl.where(live, block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, -1), mask=m)
    tl.store(ctx_ptr + r, tl.where(live, pos + 1, 0).to(tl.int32), mask=m)


@triton.jit
def _decode_advance_kernel(
    tok_ptr,
    ids_ptr,
    pos_ptr,
    out_ptr,
    step_ptr,
    rows,
    out_stride,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Sampled tokens become the next inputs and land in row `step` of the output; positions and step advance.
    CHUNKS > 0: tok_ptr holds argmax_keys' [rows, CHUNKS] keys, whose maximum per row is the token; they are set
    back to zeros, as greedy_keys wants them next step."""
    _after_producer(PDL)
    r = tl.arange(0, BLOCK)
    m = r < rows
    step = tl.load(step_ptr)
    if CHUNKS > 0:
        keys = tok_ptr + r[:, None] * CHUNKS + tl.arange(0, CHUNKS)[None, :]
        tok = _argmax_token(tl.load(keys, mask=m[:, None], other=0))
        tl.store(keys, tl.zeros([BLOCK, CHUNKS], tl.int64), mask=m[:, None])
    else:
        tok = tl.load(tok_ptr + r, mask=m)
    tl.store(out_ptr + step * out_stride + r, tok, mask=m)
    tl.store(ids_ptr + r, tok, mask=m)
    tl.store(pos_ptr + r, tl.load(pos_ptr + r, mask=m) + 1, mask=m)
    tl.store(step_ptr, step + 1)


def _key_chunks(sampled: torch.Tensor) -> int:
    """The chunk count of argmax_keys' [rows, chunks] keys; 0 for [rows] sampled tokens."""
    return sampled.shape[1] if sampled.dim() == 2 else 0
