"""CUDA backend Triton kernels against ReferenceKernels, on the CPU through Triton's interpreter (small shapes).

On a CUDA machine the same tests run the compiled kernels on the GPU (TRITON_INTERPRET stays unset there).
"""

import contextlib
import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit of the module below

triton = pytest.importorskip("triton", reason="triton is a test dependency (pip install triton)")
tl = triton.language

import flashnext.plugins.cuda.drafting as drafting  # noqa: E402
import flashnext.plugins.cuda.gemv as gemv_module  # noqa: E402
import flashnext.plugins.cuda.kernels as kernels_module  # noqa: E402
import flashnext.plugins.cuda.launch as launch_module  # noqa: E402
import flashnext.plugins.cuda.quant as quant_module  # noqa: E402
from flashnext.core.kernels import AttentionMetadata, ReferenceKernels  # noqa: E402
from flashnext.core.precision import Fp8Weight, fp8_quantize, int4_quantize  # noqa: E402
from flashnext.plugins.cuda.drafting import DeviceNgramDrafter  # noqa: E402
from flashnext.plugins.cuda.kernels import CudaKernels  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
REF, CUDA = ReferenceKernels(), CudaKernels()


def within_one_ulp(a, b, mantissa_bits):
    """Equal up to one unit in the last place: Triton's interpreter truncates where GPUs round to nearest."""
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= b.abs() * 2.0**-mantissa_bits + 1e-30).all())


def nmse(a, b):
    a, b = a.float(), b.float()
    return float((a - b).pow(2).sum() / b.pow(2).sum().clamp_min(1e-30))


@pytest.fixture(autouse=True)
def _seeded():
    """Fixed inputs: the error bounds below hold for these draws whatever order xdist runs the tests in."""
    torch.manual_seed(1234)


def rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def test_rmsnorm_and_add_rmsnorm_match_reference():
    x, res, w = rand(5, 96), rand(5, 96), rand(96)
    assert nmse(CUDA.rmsnorm(x, w, 1e-6), REF.rmsnorm(x, w, 1e-6)) < 1e-4
    out, new_res = CUDA.add_rmsnorm(x, res, w, 1e-6)
    ref_out, ref_res = REF.add_rmsnorm(x, res, w, 1e-6)
    assert nmse(new_res, ref_res) < 1e-4  # the interpreter truncates to bf16 where GPUs round
    assert nmse(out, ref_out) < 1e-4


@pytest.mark.parametrize("silu,with_residual,rows", [(False, True, 1), (True, True, 2), (False, False, 1)])
def test_fused_norm_gemv_matches_unfused(silu, with_residual, rows):
    k, n = 64, 40
    x, w_norm = rand(rows, k), rand(k)
    res = rand(rows, k) if with_residual else None
    w = rand(2 * n if silu else n, k, scale=0.1)
    out, new_res = CUDA.norm_linear(x, res, w_norm, 1e-6, w, silu=silu)
    if with_residual:
        normed, ref_res = REF.add_rmsnorm(x, res, w_norm, 1e-6)
    else:
        normed, ref_res = REF.rmsnorm(x, w_norm, 1e-6), x
    ref = REF.linear(normed, w)
    ref = REF.silu_and_mul(ref) if silu else ref
    assert out.shape == ref.shape
    assert nmse(new_res, ref_res) < 1e-4  # the interpreter truncates to bf16 where GPUs round
    assert nmse(out, ref) < (1e-3 if silu else 1e-4)  # four bf16 roundings in a row with silu


@pytest.mark.parametrize("rows,n,k", [(1, 40, 64), (2, 24, 96)])
def test_plain_gemv_matches_linear(rows, n, k):
    x, w = rand(rows, k), rand(n, k, scale=0.1)
    assert nmse(CUDA.linear(x, w), REF.linear(x, w)) < 1e-4
    for config in ((1, 4), (4, 8)):  # every block shape computes the same function
        assert nmse(CUDA.gemv(x, w, config=config), REF.linear(x, w)) < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_argmax_in_two_halves_is_torchs(dtype):
    """argmax_keys (chunk maxima, packed with their indices) + decode_advance (the maximum of those) pick what
    torch.argmax picks: the first of equal maxima, across chunks too, negative rows and a length the chunks do
    not divide included."""
    logits = rand(4, 1000, dtype=dtype)
    logits[0, [10, 700]] = 9.0  # a tie across chunks: the first wins
    logits[1, [301, 302]] = 9.0  # within one chunk
    logits[2] = -logits[2].abs() - 1  # all negative
    keys = CUDA.argmax_keys(logits, chunks=8)
    ids, positions = torch.zeros(4, dtype=torch.int64, device=DEV), torch.zeros(4, dtype=torch.int64, device=DEV)
    out, step = torch.zeros(1, 4, dtype=torch.int64, device=DEV), torch.zeros(1, dtype=torch.int64, device=DEV)
    CUDA.decode_advance(keys, ids, positions, out, step)
    assert out[0].tolist() == logits.float().argmax(-1).tolist() and out[0, :2].tolist() == [10, 301]
    assert ids.tolist() == out[0].tolist() and positions.tolist() == [1] * 4


def test_decode_step_bookkeeping_kernels():
    block_size = 4
    tables = torch.tensor([[7, 2, 5], [1, 0, 0], [3, 3, 3]], dtype=torch.int32, device=DEV)
    positions = torch.tensor([9, 2, 0], device=DEV)
    live = torch.tensor([1, 1, 0], device=DEV)
    slots, ctx = CUDA.decode_inputs(positions, live, tables, block_size)
    assert slots.tolist() == [5 * 4 + 1, 1 * 4 + 2, -1]
    assert ctx.tolist() == [10, 3, 0]
    out = torch.zeros(3, 3, dtype=torch.int64, device=DEV)
    ids, step = torch.zeros(3, dtype=torch.int64, device=DEV), torch.tensor([1], device=DEV)
    CUDA.decode_advance(torch.tensor([11, 12, 13], device=DEV), ids, positions, out, step)
    assert out[1].tolist() == [11, 12, 13] and out[0].tolist() == [0, 0, 0]
    assert ids.tolist() == [11, 12, 13] and positions.tolist() == [10, 3, 1] and step.item() == 2


# Row counts off the kernel's 4-row tiles, widths under its 1,024-column tile (576, 384: padded) and over it (2,560:
# a partly filled third tile).
@pytest.mark.parametrize("n,k,group_size", [(24, 256, 32), (23, 256, 128), (5, 576, 32), (7, 384, 128), (9, 2560, 128)])
def test_int4_dequantize_kernel_matches_int4weight(n, k, group_size):
    w = int4_quantize(torch.randn(n, k), group_size=group_size, symmetric=False).to(DEV)
    # allclose, not equal: the GPU may fuse q * s + o into one FMA (one rounding instead of two)
    assert torch.allclose(CUDA.int4_dequantize(w, torch.float32), w.dequantize(torch.float32), rtol=1e-6, atol=1e-6)
    # bf16 within one unit in the last place (Triton's interpreter truncates where the GPU rounds)
    got = CUDA.int4_dequantize(w, torch.bfloat16).float()
    assert torch.allclose(got, w.dequantize(torch.float32), rtol=2**-7, atol=0)


@pytest.mark.parametrize("k,group_size", [(256, 32), (576, 32), (384, 128)])  # 576: SmolLM2, groups padded
def test_int4_fused_norm_gemv_with_silu(k, group_size):
    x, res, w_norm = rand(1, k), rand(1, k), rand(k)
    w = int4_quantize(torch.randn(2 * 24, k), group_size=group_size).to(DEV)
    out, _ = CUDA.norm_linear(x, res, w_norm, 1e-6, w, silu=True)
    ref = REF.silu_and_mul(REF.linear(REF.add_rmsnorm(x, res, w_norm, 1e-6)[0], w))
    assert nmse(out, ref) < 1e-3


def _int8_rows_model(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x rounded to int8 a group of columns at a time, in float64 (scale: the group's largest magnitude / 127), as
    (the integers in column order, scales, sums)."""
    groups = x.double().reshape(x.shape[0], -1, group)
    scale = groups.abs().amax(-1) / 127.0
    xi = torch.floor(groups / scale.clamp_min(1e-300)[..., None] + 0.5)
    return xi.reshape(x.shape), scale, xi.sum(-1)


def _int8_blocks_model(x: torch.Tensor, w, block: int = gemv_module.X_BLOCK.value) -> torch.Tensor:
    """What the int4 GEMV (blocks of X_BLOCK columns) or the W4A8 skinny GEMM (the weight's groups) computes, in
    float64: x rounded to int8 a block at a time (_int8_rows_model), times the dequantized weight."""
    xi, scale, _ = _int8_rows_model(x, block)
    rounded = (xi.reshape(x.shape[0], -1, block) * scale[..., None]).reshape(x.shape)
    return rounded @ w.dequantize(torch.float64).T


@pytest.mark.parametrize("k,group_size", [(256, 32), (576, 32), (384, 128), (256, 64)])
def test_int4_gemv_meets_x_as_int8_blocks(k, group_size):
    """fp32 rows (no output rounding): the int4 GEMV equals x quantized to int8 blocks times the dequantized weight
    up to float32 summation, and so differs from x as it is by the blocks' rounding, visibly more."""
    w = int4_quantize(torch.randn(40, k) * 0.1, group_size=group_size, symmetric=group_size != 64).to(DEV)
    x = rand(2, k, dtype=torch.float32)
    x[1, 5] = 40.0  # an outlier coarsens its block only
    out = CUDA.linear(x, w)
    assert nmse(out, _int8_blocks_model(x, w)) < 1e-11
    assert nmse(out, x.double() @ w.dequantize(torch.float64).T) > 1e-7


def _packed_x_model(x: torch.Tensor, w) -> torch.Tensor:
    """_int8_blocks_model at PACKED_BLOCK: what the int4 GEMV computes from a PackedX of x."""
    return _int8_blocks_model(x, w, gemv_module.PACKED_BLOCK.value)


@pytest.fixture
def packs_any_row(monkeypatch):
    """PackedX hand-overs for rows of any length (PACKED_X_MIN_K keeps them to long rows), at test shapes."""
    monkeypatch.setattr(launch_module, "PACKED_X_MIN_K", 0)


@pytest.mark.parametrize("rows,group_size", [(1, 128), (3, 32)])
def test_int4_gemvs_hand_over_x_packed_with_the_residual_and_norm(rows, group_size, packs_any_row):
    """fp32 rows: an int4 GEMV (o or down) writes its output + residual, times the next norm's weight, rounded in
    blocks, as the next int4 GEMV's PackedX, and stores the new residual; the next GEMV's dots then take 1 / rms of
    that sum: exactly x rounded in PACKED_BLOCK blocks times the dequantized weight, scaled by 1 / rms."""
    w1 = int4_quantize(torch.randn(256, 96) * 0.1, group_size=32).to(DEV)
    w2 = int4_quantize(torch.randn(40, 256) * 0.1, group_size=group_size).to(DEV)
    x, residual, norm_w = rand(rows, 96, dtype=torch.float32), rand(rows, 256, dtype=torch.float32), rand(256)
    residual[-1, 7] = 30.0  # an outlier coarsens its block only
    packed, new_residual = CUDA.linear_into(x, w1, residual, norm_w, w2)
    assert isinstance(packed, gemv_module.PackedX) and packed.shape == (rows, 256)
    summed = CUDA.linear(x, w1) + residual
    assert torch.equal(new_residual, summed)
    out, passed_on = CUDA.norm_linear(packed, new_residual, norm_w, 1e-6, w2)
    assert passed_on is new_residual
    rms = torch.rsqrt(summed.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert nmse(out, _packed_x_model(summed * norm_w.float(), w2) * rms) < 1e-11
    unpacked, _ = CUDA.norm_linear(CUDA.linear(x, w1), residual, norm_w, 1e-6, w2)
    assert 1e-9 < nmse(out, unpacked) < 1e-3  # blocks of 16 columns here, of 32 there


def test_the_silu_gemv_hands_the_down_projection_x_packed(packs_any_row):
    """The gate/up GEMV (norm + SiLU) feeding an int4 down projection writes its activations as that one's
    PackedX (no norm between: no sums of squares); the down GEMV computes them rounded in PACKED_BLOCK blocks.
    Handed on packed again, 16-bit activations stay 16-bit outputs."""
    x, residual, norm_w = rand(2, 64, dtype=torch.float32), rand(2, 64, dtype=torch.float32), rand(64)
    gate_up = int4_quantize(torch.randn(2 * 96, 64) * 0.1, group_size=64).to(DEV)
    down = int4_quantize(torch.randn(64, 96) * 0.1, group_size=32).to(DEV)
    packed, new_residual = CUDA.norm_linear(x, residual, norm_w, 1e-6, gate_up, silu=True, feeds=down)
    act, same_residual = CUDA.norm_linear(x, residual, norm_w, 1e-6, gate_up, silu=True)
    assert isinstance(packed, gemv_module.PackedX) and packed.parts == 0
    assert torch.equal(new_residual, same_residual)
    assert nmse(CUDA.linear(packed, down), _packed_x_model(act, down)) < 1e-11
    x16, residual16 = x.to(torch.bfloat16), residual.to(torch.bfloat16)
    packed16, _ = CUDA.norm_linear(x16, residual16, norm_w, 1e-6, gate_up, silu=True, feeds=down)
    down_packed, residual_out = CUDA.linear_into(packed16, down, residual16, norm_w, gate_up)
    assert packed16.dtype == down_packed.dtype == torch.bfloat16 and residual_out.dtype == torch.bfloat16
    assert CUDA.norm_linear(down_packed, residual_out, norm_w, 1e-6, gate_up, silu=True)[0].dtype == torch.bfloat16


def test_x_is_packed_only_between_int4_register_gemvs(monkeypatch):
    """Plain outputs and the residual as given where the next projection is not an int4 GEMV of rows of at least
    PACKED_X_MIN_K columns (a short row, a 16-bit weight, more rows than the GEMV takes, the last layer's, packed_x
    off)."""
    w1 = int4_quantize(torch.randn(64, 64) * 0.1, group_size=64).to(DEV)
    w2 = int4_quantize(torch.randn(32, 64) * 0.1, group_size=64).to(DEV)
    residual, norm_w = rand(1, 64), rand(64)
    off = CudaKernels()
    off.packed_x = False
    cases = [
        (CUDA, rand(1, 64), w2),
        (CUDA, rand(1, 64), rand(32, 64)),
        (CUDA, rand(8, 64), w2),
        (CUDA, rand(1, 64), None),
        (off, rand(1, 64), w2),
    ]
    for kernels, x, feeds in cases:
        out, passed_on = kernels.linear_into(x, w1, residual[:1].expand(x.shape[0], 64), norm_w, feeds)
        assert isinstance(out, torch.Tensor) and passed_on.data_ptr() == residual.data_ptr()
        monkeypatch.setattr(launch_module, "PACKED_X_MIN_K", 0)  # the first case: too short a row
    assert isinstance(CUDA.linear_into(rand(1, 64), w1, residual, norm_w, w2)[0], gemv_module.PackedX)


def test_packed_rows_compute_as_one_row_calls(packs_any_row):
    """A verify step's rows handed on packed (the GEMV up to gemv_max_rows rows) give exactly what one-row calls
    give, as the decode step they check must reproduce."""
    w1 = int4_quantize(torch.randn(64, 96) * 0.1, group_size=32).to(DEV)
    w2 = int4_quantize(torch.randn(48, 64) * 0.1, group_size=64).to(DEV)
    x, residual, norm_w = rand(5, 96), rand(5, 64), rand(64)
    kernels = CudaKernels()
    kernels.gemv_max_rows = 5

    def chain(rows):
        packed, new_residual = kernels.linear_into(x[rows], w1, residual[rows], norm_w, w2)
        return kernels.norm_linear(packed, new_residual, norm_w, 1e-6, w2)[0]

    together = chain(slice(0, 5))
    assert all(torch.equal(together[i], chain(slice(i, i + 1))[0]) for i in range(5))


def test_int4_gemv_keeps_non_finite_rows_non_finite():
    """Rounding x to int8 must not drop a NaN or inf: its row's outputs are NaN, as a float dot's would be, and the
    other rows stay finite."""
    w = int4_quantize(torch.randn(24, 256) * 0.1, group_size=32).to(DEV)
    x = rand(3, 256)
    x[0, 5], x[2, 200] = float("nan"), float("inf")
    out = CUDA.linear(x, w)
    assert torch.isnan(out[0]).all() and not torch.isfinite(out[2]).any() and torch.isfinite(out[1]).all()


@triton.jit
def _dp4a_kernel_for_test(a_ptr, b_ptr, c_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, gemv_module._dp4a(tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(c_ptr + i)))


def test_dp4a_sums_unsigned_bytes_times_signed_bytes():
    """The GPU's dp4a instruction and the interpreter's spelled-out sum agree with integer arithmetic, sign bytes
    and the accumulator included."""
    n = 64
    a = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=DEV)
    b = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=DEV)
    c = torch.randint(-(2**20), 2**20, (n,), dtype=torch.int32, device=DEV)
    out = torch.empty_like(a)
    _dp4a_kernel_for_test[(1,)](a, b, c, out, N=n)
    a_bytes = a.cpu().view(torch.uint8).reshape(n, 4).long()
    b_bytes = b.cpu().view(torch.int8).reshape(n, 4).long()
    assert torch.equal(out.cpu().long(), c.cpu().long() + (a_bytes * b_bytes).sum(1))


def _paged_setup(query_lens, context_lens, heads=4, kv_heads=2, dim=32, block_size=4, kv_dtype=torch.bfloat16):
    """A shuffled paged cache holding each sequence's context; returns q, caches and the metadata."""
    n_blocks = sum(-(-c // block_size) for c in context_lens) + 2
    k_cache = torch.randn(n_blocks, block_size, kv_heads, dim, device=DEV).to(kv_dtype)
    v_cache = torch.randn(n_blocks, block_size, kv_heads, dim, device=DEV).to(kv_dtype)
    order = torch.randperm(n_blocks).tolist()
    tables, used = [], 0
    for c in context_lens:
        need = -(-c // block_size)
        tables.append(order[used : used + need])
        used += need
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64, device=DEV),
        query_start=torch.tensor(starts, dtype=torch.int32, device=DEV),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEV),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        query_lens_host=tuple(query_lens),
        context_lens_host=tuple(context_lens),
    )
    return rand(starts[-1], heads, dim), k_cache, v_cache, meta


@pytest.mark.parametrize("query_lens,context_lens", [([5, 1, 3], [5, 7, 11]), ([1, 1], [9, 70])])
def test_paged_attention_matches_reference(query_lens, context_lens):
    q, kc, vc, meta = _paged_setup(query_lens, context_lens)
    ref = REF.attention(q, kc, vc, meta, 0.17)
    assert nmse(CUDA.attention(q, kc, vc, meta, 0.17), ref) < 1e-4


def test_split_kv_decode_attention_matches_reference():
    q, kc, vc, meta = _paged_setup([1, 1, 1], [3, 40, 70])
    ref = REF.attention(q, kc, vc, meta, 0.2)
    assert nmse(CudaKernels(decode_splits=4).attention(q, kc, vc, meta, 0.2), ref) < 1e-4


@pytest.mark.parametrize("splits", [1, 4])
def test_verify_rows_attend_as_decode_rows(splits):
    """K + 1 query rows of a sequence, each given its own context length and sharing the sequence's table row,
    equal the causal multi-query attention, and each row equals a one-row decode call with that context."""
    q, kc, vc, meta = _paged_setup([4, 4], [9, 23])
    ref = REF.attention(q, kc, vc, meta, 0.2)
    per_row = [c - 4 + i + 1 for c in (9, 23) for i in range(4)]
    rows_meta = AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        query_start=torch.arange(9, dtype=torch.int32, device=DEV),
        context_lens=torch.tensor(per_row, dtype=torch.int32, device=DEV),
        block_tables=meta.block_tables,
        max_query_len=1,
        max_context_len=23,
    )
    kernels = CudaKernels(decode_splits=splits)
    rows = kernels.attention(q, kc, vc, rows_meta, 0.2)
    assert nmse(rows, ref) < 1e-4
    one = AttentionMetadata(
        slot_mapping=meta.slot_mapping[:1],
        query_start=torch.arange(2, dtype=torch.int32, device=DEV),
        context_lens=torch.tensor([per_row[6]], dtype=torch.int32, device=DEV),
        block_tables=meta.block_tables[1:],
        max_query_len=1,
        max_context_len=23,
    )
    assert torch.equal(kernels.attention(q[6:7], kc, vc, one, 0.2)[0], rows[6])


def _verify_slots(positions, block_tables, rows_per_table, block_size):
    """The cache slot of each verify row's position: rows_per_table consecutive rows share a table row."""
    tables = block_tables.tolist()
    return torch.tensor(
        [
            tables[j // rows_per_table][p // block_size] * block_size + p % block_size
            for j, p in enumerate(positions.tolist())
        ],
        device=DEV,
    )


def _rows_meta(rows, slots, context_lens, block_tables, rows_per_table):
    """Metadata of a verify step's `rows` (rows_per_table a sequence), or of one of them as a one-row decode call."""
    return AttentionMetadata(
        slot_mapping=slots[rows],
        query_start=torch.arange(len(rows) + 1, dtype=torch.int32, device=DEV),
        context_lens=context_lens[rows],
        max_query_len=1,
        max_context_len=int(context_lens.max()),
        block_tables=block_tables[[rows[0] // rows_per_table]] if len(rows) == 1 else block_tables,
    )


def _rope_table(dim, positions):
    angles = torch.outer(torch.arange(float(positions)), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    return torch.cat((angles.cos(), angles.sin()), -1).to(DEV)


@pytest.mark.parametrize(
    "group,kv_dtype",
    [
        (1, torch.bfloat16),
        (3, torch.bfloat16),
        pytest.param(
            3,
            torch.float8_e5m2,
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="fp8 casts are checked on the GPU"),
            ],
        ),
    ],
)
def test_split_decode_with_rope_folded_in_equals_rope_then_attention(group, kv_dtype):
    """rope_attention of a split decode step (q/k norm, rope and the KV write inside the attention kernel) gives
    the bits of qkv_rope_store followed by attention, cache included, an fp8-e5m2 cache too. group 3: verify rows
    (3 consecutive rows of a sequence share its table row, each attending up to its own position, the later ones
    to the new keys of the earlier ones)."""
    heads, kv_heads, dim, block_size = 4, 2, 32, 4
    # 33: the new keys straddle two splits (slices of 32); 170: they sit past the first key tile of their slice
    contexts = [5, 33, 170]
    _, kc, vc, meta = _paged_setup([1, 1, 1], contexts, heads, kv_heads, dim, block_size, kv_dtype)
    positions = torch.tensor([c - group + i for c in contexts for i in range(group)], device=DEV)
    slots = _verify_slots(positions, meta.block_tables, group, block_size)
    slots[1 if group > 1 else 0] = -1  # a padded row writes nothing
    rows_meta = AttentionMetadata(
        slot_mapping=slots,
        query_start=torch.arange(len(slots) + 1, dtype=torch.int32, device=DEV),
        context_lens=(positions + 1).to(torch.int32),
        block_tables=meta.block_tables,
        max_query_len=1,
        max_context_len=max(contexts),
    )
    qkv = rand(len(slots), (heads + 2 * kv_heads) * dim)
    q_norm, k_norm, cos_sin = rand(dim), rand(dim), _rope_table(dim, max(contexts))
    kernels = CudaKernels(decode_splits=4)
    caches = [c.clone() for c in (kc, vc, kc, vc)]
    fused = kernels.rope_attention(
        qkv, q_norm, k_norm, 1e-6, positions, cos_sin, caches[0], caches[1], rows_meta, 0.2, heads, kv_heads, dim
    )
    q = kernels.qkv_rope_store(
        qkv, q_norm, k_norm, 1e-6, positions, cos_sin, caches[2], caches[3], slots, heads, kv_heads, dim
    )

    def same(a, b):  # bitwise, fp8 included
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    assert same(caches[0], caches[2]) and same(caches[1], caches[3])
    assert not same(caches[0], kc)  # the new keys did land
    unfused = kernels.attention(q, caches[2], caches[3], rows_meta, 0.2)
    assert torch.equal(fused, unfused) and not fused.isnan().any()


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("contexts", [[127, 44], [3, 200]])
def test_verify_rows_sharing_programs_equal_one_row_calls(contexts, qk_norm):
    """Five verify rows a sequence, eight query heads to a kv head (two rows a program, three programs a
    sequence), rope folded in, with q/k norm (Qwen3: the new keys a row at a time) and without (Llama: unrolled):
    each row equals a one-row decode call at its own position, also where the rows' KV slices differ (contexts
    128..132 over 4 splits: slices of 32 up to 128, of 64 past it; rows 128 and 129 share a program)."""
    heads, kv_heads, dim, block_size, k1 = 8, 1, 32, 4, 5
    _, kc, vc, meta = _paged_setup([1] * len(contexts), [c + k1 for c in contexts], heads, kv_heads, dim, block_size)
    positions = torch.tensor([c + i for c in contexts for i in range(k1)], device=DEV)
    slots = _verify_slots(positions, meta.block_tables, k1, block_size)
    qkv = rand(len(slots), (heads + 2 * kv_heads) * dim)
    q_norm, k_norm = (rand(dim), rand(dim)) if qk_norm else (None, None)
    cos_sin = _rope_table(dim, max(contexts) + k1)
    kernels = CudaKernels(decode_splits=4)

    def step(rows, k_cache, v_cache):
        row_meta = _rows_meta(rows, slots, (positions + 1).to(torch.int32), meta.block_tables, k1)
        return kernels.rope_attention(
            qkv[rows],
            q_norm,
            k_norm,
            1e-6,
            positions[rows],
            cos_sin,
            k_cache,
            v_cache,
            row_meta,
            0.2,
            heads,
            kv_heads,
            dim,
        )

    verify = step(list(range(len(slots))), kc, vc)
    for i in range(len(slots)):
        assert torch.equal(step([i], kc.clone(), vc.clone())[0], verify[i]), i


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1)])
@pytest.mark.parametrize("live", [1, 2])
def test_verify_rows_past_the_drafts_attend_to_nothing(heads, kv_heads, live):
    """A verify step's rows past its drafts (context 0, no slot) come out zero and write no keys; the live rows
    equal one-row decode calls. With a sequence's own token its only live row, its program runs as a decode row
    (3 query heads a kv head: one program a sequence; 8: three, and the later ones have no live row at all)."""
    dim, block_size, k1, contexts = 32, 4, 5, [40, 7]
    _, kc, vc, meta = _paged_setup([1, 1], [c + k1 for c in contexts], heads, kv_heads, dim, block_size)
    positions = torch.tensor([c + i for c in contexts for i in range(k1)], device=DEV)
    alive = torch.tensor([i < live for _ in contexts for i in range(k1)], device=DEV)
    slots = torch.where(alive, _verify_slots(positions, meta.block_tables, k1, block_size), -1)
    context_lens = torch.where(alive, positions + 1, 0).to(torch.int32)
    positions = torch.where(alive, positions, 0)  # as _spec_draft_kernel leaves a dead row
    qkv, cos_sin = rand(len(slots), (heads + 2 * kv_heads) * dim), _rope_table(dim, max(contexts) + k1)
    kernels = CudaKernels(decode_splits=4)

    def step(rows, k_cache, v_cache):
        row_meta = _rows_meta(rows, slots, context_lens, meta.block_tables, k1)
        return kernels.rope_attention(
            qkv[rows], None, None, 1e-6, positions[rows], cos_sin, k_cache, v_cache, row_meta, 0.2, heads, kv_heads, dim
        )

    caches, one_row_caches = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
    verify = step(list(range(len(slots))), *caches)
    live_rows = alive.nonzero().flatten().tolist()
    for i in live_rows:
        step([i], *one_row_caches)
    assert torch.equal(caches[0], one_row_caches[0]) and torch.equal(caches[1], one_row_caches[1])
    for i in live_rows:
        assert torch.equal(step([i], caches[0].clone(), caches[1].clone())[0], verify[i]), i
    assert (verify[~alive] == 0).all() and not verify.isnan().any()


def test_attention_reads_fp8_e5m2_cache():
    q, kc, vc, meta = _paged_setup([2, 1], [6, 9], kv_dtype=torch.float8_e5m2)
    ref = REF.attention(q, kc, vc, meta, 0.2)
    assert nmse(CUDA.attention(q, kc, vc, meta, 0.2), ref) < 1e-4
    q, kc, vc, meta = _paged_setup([1, 1], [9, 40], kv_dtype=torch.float8_e5m2)  # split-KV decode path too
    ref = REF.attention(q, kc, vc, meta, 0.2)
    assert nmse(CudaKernels(decode_splits=4).attention(q, kc, vc, meta, 0.2), ref) < 1e-4


@contextlib.contextmanager
def _launches_of(kernel_name):
    """The grids the named Triton kernel of the CUDA kernels module is launched with inside the block."""
    calls, real = [], getattr(kernels_module, kernel_name)

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    setattr(kernels_module, kernel_name, Spy())
    try:
        yield calls
    finally:
        setattr(kernels_module, kernel_name, real)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 32), (9, 3, 64)])
def test_decode_over_fp8_e5m2_cache_read_as_16_bit_pairs(heads, kv_heads, dim):
    """Decode rows over an fp8-e5m2 cache go through _decode_e5m2_kernel (the cache as int16 pairs, even and odd
    elements in separate dots): equal to exact attention over the cache's values, past a 128-key tile, a row with
    no context comes out zero, and rows sharing a table row (a verify step's) see only their own contexts."""
    contexts = [1, 9, 130, 0]
    q, kc, vc, meta = _paged_setup([1] * 4, contexts, heads, kv_heads, dim, kv_dtype=torch.float8_e5m2)
    with _launches_of("_decode_e5m2_kernel") as calls:
        out = CUDA.attention(q, kc, vc, meta, 0.2)
    assert calls == [(4, kv_heads)]
    ref = REF.attention(q, kc, vc, meta, 0.2)
    assert nmse(out, ref) < 1e-4 and (out[3] == 0).all()
    shared = AttentionMetadata(  # rows 0-1 and 2-3 each share a table row, attending to 5 / 9 and 20 / 130 keys
        slot_mapping=meta.slot_mapping,
        query_start=meta.query_start,
        max_query_len=1,
        max_context_len=130,
        context_lens=torch.tensor([5, 9, 20, 130], dtype=torch.int32, device=DEV),
        block_tables=meta.block_tables[[2, 2]].contiguous(),
        query_lens_host=(1,) * 4,
        context_lens_host=(5, 9, 20, 130),
    )
    one_table = dataclasses.replace(shared, block_tables=meta.block_tables[[2, 2, 2, 2]].contiguous())
    assert nmse(CUDA.attention(q, kc, vc, shared, 0.2), REF.attention(q, kc, vc, one_table, 0.2)) < 1e-4
    with _launches_of("_decode_e5m2_kernel") as calls:  # fp32 activations keep the paged kernel's fp32 dots
        CUDA.attention(q.float(), kc, vc, meta, 0.2)
    assert calls == []


def _e5m2_decode_step(heads, kv_heads, dim):
    """Four decode rows over a shuffled fp8-e5m2 cache, contexts 5, 130, 1 and a padded row (slot -1, context 0):
    (caches, metadata, positions, slots, qkv rows, rope table, contexts)."""
    contexts = [5, 130, 1, 0]
    _, kc, vc, meta = _paged_setup(
        [1] * 4, [max(c, 1) for c in contexts], heads, kv_heads, dim, kv_dtype=torch.float8_e5m2
    )
    positions = torch.tensor([max(c - 1, 0) for c in contexts], device=DEV)
    slots = _verify_slots(positions, meta.block_tables, 1, 4)
    slots[3] = -1
    rows_meta = dataclasses.replace(
        meta, slot_mapping=slots, context_lens=torch.tensor(contexts, dtype=torch.int32, device=DEV)
    )
    qkv = rand(4, (heads + 2 * kv_heads) * dim)
    return kc, vc, rows_meta, positions, slots, qkv, _rope_table(dim, max(contexts)), contexts


@pytest.mark.parametrize("heads,kv_heads,dim,qk_norm", [(4, 2, 32, True), (9, 3, 64, False)])
def test_e5m2_decode_with_rope_folded_in_equals_rope_then_attention(heads, kv_heads, dim, qk_norm):
    """rope_attention of a decode step over an fp8-e5m2 cache (q/k norm, rope and the KV write inside
    _decode_e5m2_kernel) gives the bits of qkv_rope_store followed by attention, cache included; a padded row
    (slot -1, context 0) writes nothing and comes out zero."""
    kc, vc, rows_meta, positions, slots, qkv, cos_sin, contexts = _e5m2_decode_step(heads, kv_heads, dim)
    q_norm, k_norm = (rand(dim), rand(dim)) if qk_norm else (None, None)
    caches = [c.clone() for c in (kc, vc, kc, vc)]
    fused = CUDA.rope_attention(
        qkv, q_norm, k_norm, 1e-6, positions, cos_sin, caches[0], caches[1], rows_meta, 0.2, heads, kv_heads, dim
    )
    q = CUDA.qkv_rope_store(
        qkv, q_norm, k_norm, 1e-6, positions, cos_sin, caches[2], caches[3], slots, heads, kv_heads, dim
    )
    unfused = CUDA.attention(q, caches[2], caches[3], rows_meta, 0.2)

    def same(a, b):  # bitwise, fp8 included
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    assert same(caches[0], caches[2]) and same(caches[1], caches[3]) and not same(caches[0], kc)
    assert torch.equal(fused, unfused) and (fused[3] == 0).all() and not fused.isnan().any()
    ref = REF.attention(q, caches[2], caches[3], dataclasses.replace(rows_meta, context_lens_host=tuple(contexts)), 0.2)
    assert nmse(fused, ref) < 1e-4


def _grouped_fp8_product(rows, w8):
    """rows @ w8.T with rows' scale per (token, group of columns): each group's fp8 product scaled by its own."""
    x, w, g = rows.data.float(), w8.data.float(), rows.group
    parts = [x[:, i : i + g] @ w[:, i : i + g].T * rows.scale[:, i // g : i // g + 1] for i in range(0, x.shape[1], g)]
    return sum(parts) * w8.scale.reshape(1, -1)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 32), (9, 3, 64)])
def test_e5m2_decode_feeding_an_fp8_projection_writes_fp8_rows_scaled_per_head(heads, kv_heads, dim, monkeypatch):
    """rope_attention told its output feeds the skinny fp8 GEMM writes it as fp8 with a scale per token and kv
    group (a power of two of heads) or head: the group's amax of the 16-bit output over 448, values within e4m3's
    rounding of it; the o projection of those rows is each group's fp8 product scaled by its own scale, with no
    quantization pass between. Where the register GEMV takes the rows (16-bit activations), or the step has
    HEAD_SCALES_ABOVE_ROWS rows or fewer, the output stays 16-bit."""
    kc, vc, rows_meta, positions, _, qkv, cos_sin, _ = _e5m2_decode_step(heads, kv_heads, dim)
    o_weight = fp8_quantize(torch.randn(48, heads * dim)).to(DEV)
    caches = [c.clone() for c in (kc, vc, kc, vc)]
    args = (None, None, 1e-6, positions, cos_sin)
    plain = CUDA.rope_attention(qkv, *args, caches[2], caches[3], rows_meta, 0.2, heads, kv_heads, dim)
    gemm = CudaKernels(register_gemv=False)  # four rows would take the GEMV
    caches_16 = [c.clone() for c in (kc, vc)]
    small_step = gemm.rope_attention(qkv, *args, *caches_16, rows_meta, 0.2, heads, kv_heads, dim, feeds=o_weight)
    assert torch.equal(small_step, plain.flatten(1))
    monkeypatch.setattr(launch_module, "HEAD_SCALES_ABOVE_ROWS", 3)
    with _launches_of("_fp8_quant_rows_kernel") as quant_passes:
        rows = gemm.rope_attention(
            qkv, *args, caches[0], caches[1], rows_meta, 0.2, heads, kv_heads, dim, feeds=o_weight
        )
        out = gemm.linear(rows, o_weight)
    group_heads = 2 if kv_heads * 2 == heads else 1  # a power-of-two kv group shares one scale
    assert quant_passes == [] and isinstance(rows, quant_module.Fp8Rows) and rows.group == group_heads * dim
    assert rows.data.shape == (4, heads * dim) and rows.scale.shape == (4, heads // group_heads)
    per_group = plain.float().view(4, heads // group_heads, group_heads * dim)
    amax = per_group.abs().amax(-1)
    assert torch.equal(rows.scale, (amax / 448).where(amax > 0, torch.ones(())))
    dequantized = rows.data.float().view(per_group.shape) * rows.scale[:, :, None]
    assert nmse(dequantized, per_group) < 6e-3 and (dequantized[3] == 0).all()  # e4m3: 3 mantissa bits
    if DEV == "cuda":  # the interpreter's fp8 casts truncate (see FP8_ON_GPU): bits on the GPU only
        expected = (per_group / rows.scale[:, :, None]).to(torch.float8_e4m3fn).view(4, -1)
        assert torch.equal(rows.data.view(torch.uint8), expected.view(torch.uint8))
    assert nmse(out, _grouped_fp8_product(rows, o_weight)) < 5e-5  # the bf16 output's rounding (truncated here)
    assert nmse(out, REF.linear(plain.flatten(1), o_weight)) < 1e-2
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    for kernels, weight in ((gemm, rand(48, heads * dim)), (CUDA, o_weight)):
        caches = [c.clone() for c in (kc, vc)]
        flat = kernels.rope_attention(qkv, *args, *caches, rows_meta, 0.2, heads, kv_heads, dim, feeds=weight)
        assert torch.equal(flat, plain.flatten(1))


def test_grouped_silu_and_mul_fp8_scales_each_program_s_columns():
    """silu_and_mul_fp8(grouped): a scale per token and 1,024 columns (the last group partial), each its group's
    amax over 448; the skinny fp8 GEMM after it (K steps narrower than a group) scales each group's product."""
    x = rand(3, 2 * 1536)
    rows = CUDA.silu_and_mul_fp8(x, grouped=True)
    act = CUDA.silu_and_mul(x).float()  # the same 16-bit values (the interpreter rounds its own way)
    assert rows.group == 1024 and rows.scale.shape == (3, 2)
    amax = torch.stack([act[:, :1024].abs().amax(1), act[:, 1024:].abs().amax(1)], 1)
    assert torch.equal(rows.scale, amax / 448)
    per_column = rows.scale.repeat_interleave(1024, 1)[:, :1536]
    assert nmse(rows.data.float() * per_column, act) < 6e-3  # e4m3: 3 mantissa bits (the interpreter truncates)
    if DEV == "cuda":
        assert torch.equal(rows.data.view(torch.uint8), (act / per_column).to(torch.float8_e4m3fn).view(torch.uint8))
    w8 = fp8_quantize(torch.randn(40, 1536)).to(DEV)
    out = CudaKernels(register_gemv=False).linear(rows, w8)
    assert nmse(out, _grouped_fp8_product(rows, w8)) < 5e-5
    assert nmse(out, REF.linear(REF.silu_and_mul(x), w8)) < 1e-2
    assert CUDA.silu_and_mul_fp8(x).scale.shape == (3, 1)  # per token by default


@pytest.mark.parametrize("group,config", [(32, (16, 64, 2, 1)), (64, (16, 32, 2, 1)), (32, (32, 128, 3, 2))])
def test_skinny_gemm_applies_a_scale_per_group_of_columns(group, config):
    """Fp8Rows with group > 0: each group's partial product takes its own scale, groups narrower or wider than
    the config's K step, split K included."""
    rows, k = 5, 256
    x = rand(rows, k)
    data, scale = CUDA.fp8_quantize_rows(x.view(rows * k // group, group))
    grouped = quant_module.Fp8Rows(data.view(rows, k), scale.view(rows, k // group), x.dtype, group)
    w8 = fp8_quantize(torch.randn(40, k)).to(DEV)
    out = CudaKernels().skinny_gemm(grouped, w8, config=config)
    assert nmse(out, _grouped_fp8_product(grouped, w8)) < 5e-5  # the bf16 output's rounding
    assert nmse(out, REF.linear(x, w8)) < 1e-2


# Triton's interpreter converts to fp8 wrongly at binade edges (-31.97 -> -16), so fp8 writes are checked on GPU.
FP8_ON_GPU = pytest.param(
    False,
    torch.float8_e5m2,
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="fp8 casts are checked on the GPU"),
    ],
)


@pytest.mark.parametrize("qk_norm,kv_dtype", [(True, torch.bfloat16), (False, torch.bfloat16), FP8_ON_GPU])
def test_qkv_rope_store_matches_reference_ops(qk_norm, kv_dtype):
    tokens, heads, kv_heads, dim = 3, 4, 2, 16
    qkv = rand(tokens, (heads + 2 * kv_heads) * dim)
    q_norm, k_norm = (rand(dim), rand(dim)) if qk_norm else (None, None)
    positions = torch.tensor([0, 5, 9], device=DEV)
    slots = torch.tensor([3, -1, 6], device=DEV)  # -1: a padded row writes nothing
    cos_sin = _rope_table(dim, 16)
    shape = (2, 4, kv_heads, dim)
    caches = [torch.zeros(shape, device=DEV).to(kv_dtype) for _ in range(4)]
    q = CUDA.qkv_rope_store(
        qkv, q_norm, k_norm, 1e-6, positions, cos_sin, caches[0], caches[1], slots, heads, kv_heads, dim
    )
    rq, rk, rv = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    rq, rk, rv = rq.view(tokens, heads, dim), rk.view(tokens, kv_heads, dim), rv.view(tokens, kv_heads, dim)
    if qk_norm:
        rq, rk = REF.rmsnorm(rq, q_norm, 1e-6), REF.rmsnorm(rk, k_norm, 1e-6)
    rq, rk = REF.rope(rq, rk, positions, cos_sin)
    REF.store_kv(rk, rv, caches[2], caches[3], slots)
    assert nmse(q, rq) < 1e-4
    bound = 1e-4 if kv_dtype == torch.bfloat16 else 5e-3  # e5m2 keeps 2 mantissa bits
    assert nmse(caches[0], caches[2]) < bound and nmse(caches[1], caches[3]) < bound
    assert caches[0][0, 1].float().abs().sum() == 0  # slot 1 and the padded row's slot stay unwritten


def test_store_kv_and_silu_and_mul_match_reference():
    k, v = rand(3, 2, 8), rand(3, 2, 8)
    slots = torch.tensor([5, -1, 0], device=DEV)
    ours = [torch.zeros(2, 4, 2, 8, device=DEV, dtype=torch.bfloat16) for _ in range(2)]
    ref = [torch.zeros(2, 4, 2, 8, device=DEV, dtype=torch.bfloat16) for _ in range(2)]
    CUDA.store_kv(k, v, *ours, slots)
    REF.store_kv(k, v, *ref, slots)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    x = rand(3, 2 * 40)
    assert nmse(CUDA.silu_and_mul(x), REF.silu_and_mul(x)) < 1e-4


@pytest.mark.parametrize("rows", [3, 33])
def test_skinny_gemm_matches_reference_for_dense_and_fp8(rows):
    x, w = rand(rows, 256), rand(48, 256, scale=0.1)
    assert nmse(CUDA.linear(x, w), REF.linear(x, w)) < 1e-4  # dense 16-bit: the skinny GEMM past the GEMV's rows
    cublas = CudaKernels()
    cublas.skinny_dense = False
    assert nmse(cublas.linear(x, w), REF.linear(x, w)) < 1e-4
    w8 = fp8_quantize(torch.randn(48, 256)).to(DEV)  # per-token fp8 activations too: e4m3 rounding of x
    assert nmse(CUDA.linear(x, w8), REF.linear(x, w8)) < 1e-2
    for config in ((16, 64, 2, 1), (32, 128, 3, 1)):
        assert nmse(CUDA.skinny_gemm(x, w8, config=config), REF.linear(x, w8)) < 1e-2


@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_skinny_gemm_adds_slices_in_order(split_k):
    """K in slices, the last program to finish a tile adding the partials: the same bits as one slice-ordered sum
    whichever program arrives last, so a repeat call (the counts reset) gives identical output; fp8 too."""
    kernels = CudaKernels()
    x, w = rand(20, 512), rand(40, 512, scale=0.1)
    w8 = fp8_quantize(torch.randn(40, 512)).to(DEV)
    for weight, bound in ((w, 1e-4), (w8, 1e-2)):
        whole = kernels.skinny_gemm(x, weight, config=(16, 64, 2, 1))
        split = kernels.skinny_gemm(x, weight, config=(16, 64, 2, split_k))
        assert nmse(split, REF.linear(x, weight)) < bound and nmse(split, whole) < 1e-5
        assert torch.equal(split, kernels.skinny_gemm(x, weight, config=(16, 64, 2, split_k)))
    counts = kernels._split_k[x.device][-1][1]
    assert int(counts.abs().sum()) == 0  # every tile's count is back at 0 for the next call


def test_fp8_register_gemv_keeps_activations_16_bit():
    x, res, w_norm = rand(1, 256), rand(1, 256), rand(256)
    w8 = fp8_quantize(torch.randn(2 * 24, 256)).to(DEV)
    assert nmse(CUDA.linear(x, w8), REF.linear(x, w8)) < 1e-4
    out, _ = CUDA.norm_linear(x, res, w_norm, 1e-6, w8, silu=True)
    ref = REF.silu_and_mul(REF.linear(REF.add_rmsnorm(x, res, w_norm, 1e-6)[0], w8))
    assert nmse(out, ref) < 1e-3


# Rows 1-2: the GEMV; 5-32: the skinny GEMM widening int4 tiles (576 columns: 64-column steps; 2,048: K in two or
# four slices); 40: a pass, then the skinny GEMM; 70: a pass, then cuBLAS; 192 columns of groups of 64: 64-column
# steps.
@pytest.mark.parametrize(
    "group_size,rows,k",
    [
        (32, 1, 256),
        (128, 2, 256),
        (128, 5, 256),
        (32, 20, 256),
        (32, 7, 576),
        (128, 32, 512),
        (128, 40, 256),
        (128, 70, 256),
        (64, 9, 192),
        (128, 8, 2048),
        (32, 20, 2048),
    ],
)  # 2,048: split K
def test_int4_gemm_matches_dequantized_reference(group_size, rows, k):
    w = int4_quantize(torch.randn(48, k), group_size=group_size, symmetric=group_size == 128).to(DEV)
    x = rand(rows, k)
    assert nmse(CUDA.linear(x, w), REF.linear(x, w)) < 1e-4


def test_skinny_config_steps_by_bytes_of_a_weight_row_past_16_rows():
    from flashnext.plugins.cuda.launch import skinny_config

    assert skinny_config(4096, 1024, 64, 1) == (32, 256, 4, 1)  # fp8 qkv: 256 bytes a step, as bf16's 128 columns
    assert skinny_config(4096, 1024, 64, 2) == (32, 128, 4, 1)
    assert skinny_config(6144, 1024, 64, 1) == (64, 256, 4, 1)  # gate/up: 64 weight rows a program
    assert skinny_config(1024, 3072, 64, 1) == (16, 512, 4, 1)
    assert skinny_config(1152, 576, 64, 1) == (16, 64, 4, 1)  # SmolLM2: halved until the step divides K
    assert skinny_config(6144, 1024, 8, 1) == skinny_config(6144, 1024, 8, 2) == (32, 128, 4, 1)  # <= 16 rows
    assert skinny_config(4096, 1024, 24, 1) == skinny_config(4096, 1024, 64, 1)
    assert [launch_module.skinny_block_m(rows, launch_module.FP8) for rows in (5, 16, 17, 40)] == [16, 16, 64, 64]
    assert launch_module.skinny_block_m(24, launch_module.INT4) == 32  # int4 tiles keep the rows' power of two


def test_vocabulary_projections_take_their_own_skinny_config():
    """Past GEMV_MAX_N outputs: 64 weight rows a program, 256 bytes of a row a step (fp8 past 32 rows: 128)."""
    from flashnext.plugins.cuda.launch import skinny_config

    assert skinny_config(151936, 1024, 32, 1) == skinny_config(151936, 1024, 8, 1) == (64, 256, 3, 1)
    assert skinny_config(151936, 1024, 64, 1) == (64, 128, 3, 1)
    assert skinny_config(151936, 1024, 16, 2) == skinny_config(151936, 1024, 64, 2) == (64, 128, 3, 1)
    assert skinny_config(49152, 576, 16, 1) == (64, 64, 3, 1)  # SmolLM2: halved until the step divides K


def test_wide_outputs_fit_the_skinny_gemm_when_fp8_or_only_their_argmax_is_wanted():
    x = rand(64, 64)
    wide = launch_module.GEMV_MAX_N + 16
    fp8_head = Fp8Weight(torch.zeros(wide, 64, dtype=torch.float8_e4m3fn), torch.ones(wide, 1))
    bf16_head = torch.zeros(wide, 64, dtype=torch.bfloat16)
    assert CUDA._skinny_fits(x, fp8_head) and not CUDA._skinny_fits(rand(65, 64), fp8_head)
    assert not CUDA._skinny_fits(x, bf16_head) and CUDA._skinny_fits(x, bf16_head, keys_only=True)


@pytest.fixture
def narrow_gemv_n(monkeypatch):
    """A 300-token vocabulary counts as wide (past GEMV_MAX_N), as Qwen3's 151,936 does, at interpreter sizes."""
    monkeypatch.setattr(launch_module, "GEMV_MAX_N", 64)


@pytest.mark.parametrize("head_kind", ["fp8", "bf16"])
@pytest.mark.parametrize("rows", [2, 6])
def test_greedy_keys_fold_the_argmax_into_the_vocabulary_projection(narrow_gemv_n, head_kind, rows):
    """Past the GEMV's rows the head's skinny GEMM writes argmax keys instead of logits (no argmax pass): the
    tokens are the argmax of the logits the same kernel writes, the first of equal maxima, and decode_advance
    hands the keys back zeroed for the next step. Up to the GEMV's rows an fp8 head stays in the GEMV (logits and an
    argmax pass); a wide 16-bit one never takes the GEMV."""
    vocab, dim = 300, 64
    w = torch.randn(vocab, dim, device=DEV)
    w[250] = w[17] = 4 * w[17]  # equal logits: 17 must win
    head = fp8_quantize(w) if head_kind == "fp8" else w.to(torch.bfloat16)
    x, res, w_norm = rand(rows, dim), rand(rows, dim), rand(dim).abs() + 0.5
    x[0], res[0] = w[17].to(x.dtype), 0  # row 0's best tokens: 17 and 250
    keys = torch.zeros(rows, launch_module.argmax_chunks(vocab), dtype=torch.int64, device=DEV)
    with _launches_of("_skinny_gemm_kernel") as gemms, _launches_of("_argmax_chunks_kernel") as passes:
        CUDA.greedy_keys(x, res, w_norm, 1e-6, head, keys)
    fused = rows > launch_module.GEMV_MAX_ROWS or head_kind == "bf16"
    assert (len(gemms), len(passes)) == ((1, 0) if fused else (0, 1))
    normed = CUDA._norm_for(x, res, w_norm, 1e-6, head)[0]
    logits = CUDA.skinny_gemm(normed, head) if gemms else CUDA.norm_linear(x, res, w_norm, 1e-6, head)[0]
    ids, positions = torch.zeros(rows, dtype=torch.int64, device=DEV), torch.zeros(rows, dtype=torch.int64, device=DEV)
    out, step = torch.zeros(1, rows, dtype=torch.int64, device=DEV), torch.zeros(1, dtype=torch.int64, device=DEV)
    CUDA.decode_advance(keys, ids, positions, out, step)
    assert out[0].tolist() == logits.float().argmax(-1).tolist() and out[0, 0] == 17
    assert not keys.any()


def test_int4_skinny_config_takes_whole_groups_that_divide_k():
    from flashnext.plugins.cuda.launch import int4_skinny_config

    assert int4_skinny_config(1024, 8, 128) == (32, 256, 3, 1)
    assert int4_skinny_config(3072, 32, 128) == (16, 256, 3, 4)  # long rows: K in slices
    assert int4_skinny_config(1536, 8, 32) == (16, 256, 3, 2)
    assert int4_skinny_config(576, 5, 32)[1] == 64  # SmolLM2: 576 = 9 x 64
    assert int4_skinny_config(192, 9, 64)[1] == 64
    assert int4_skinny_config(96, 9, 64) is None


def test_fp8_row_quantization_matches_reference_scales():
    from flashnext.core.precision import fp8_quantize_per_token

    x = rand(4, 64, scale=3.0)
    x[1, 3] = float("inf")  # saturates without poisoning the row's scale
    q, scale = CUDA.fp8_quantize_rows(x)
    ref_q, ref_scale = fp8_quantize_per_token(x)
    assert torch.allclose(scale, ref_scale, rtol=1e-6)
    if torch.cuda.is_available():
        assert torch.equal(q.float(), ref_q.float())


@pytest.mark.gpu
def test_fp8_scaled_mm_linear_close_to_reference():
    if not torch.cuda.is_available():
        pytest.skip("torch._scaled_mm needs an FP8 GPU")
    w = fp8_quantize(torch.randn(64, 128)).to(DEV)
    x = rand(100, 128)  # past the skinny-GEMM rows: fp8 activations through torch._scaled_mm
    assert nmse(CUDA.linear(x, w), REF.linear(x, w)) < 2e-3


@pytest.mark.parametrize("small", [True, False], ids=["own-programs", "shared-tile"])
@pytest.mark.parametrize(
    "kind,k,rows",
    [
        ("bf16", 128, 6),
        ("fp8", 128, 6),
        ("int4", 128, 6),
        ("bf16", 576, 3),
        ("bf16", 576, 5),
        ("bf16", 1536, 8),
        ("int4", 576, 5),
    ],
)
def test_gemv_rows_are_computed_as_one_row_calls(kind, k, rows, small, monkeypatch):
    """Row invariance (what keeps 16-bit speculative verify == decode): row i of a many-row GEMV, residual, norm
    and silu included, is bit-equal to a one-row call on row i alone (widths as SmolLM2's: 576, 1536), whether
    the rows get programs of their own (small weights) or share each program's weight tile (large ones)."""
    monkeypatch.setattr(launch_module, "is_small_weight", lambda n_out, k: small)
    w = torch.randn(2 * 24, k) * 0.1
    w = {"bf16": w.to(torch.bfloat16), "fp8": fp8_quantize(w), "int4": int4_quantize(w, group_size=32)}[kind]
    w = w.to(DEV)
    x, res, w_norm = rand(rows, k), rand(rows, k), rand(k)
    kernels = CudaKernels()
    kernels.gemv_max_rows = rows
    many, many_res = kernels.norm_linear(x, res, w_norm, 1e-6, w, silu=True)
    for i in range(rows):
        one, one_res = kernels.norm_linear(x[i : i + 1], res[i : i + 1], w_norm, 1e-6, w, silu=True)
        assert torch.equal(one[0], many[i]) and torch.equal(one_res[0], many_res[i])


@pytest.mark.parametrize("rows", [5, 20])
def test_row_invariant_graphs_put_the_vocabulary_projection_through_16_row_skinny_tiles(rows, monkeypatch):
    """The vocabulary projection (wider than the GEMV takes) of a row-invariant graph runs the skinny GEMM in
    16-row tiles whatever the row count, so each row equals a one-row call (20 rows: two tiles); elsewhere it
    stays on cuBLAS."""
    monkeypatch.setattr(launch_module, "GEMV_MAX_N", 256)
    tiles = []
    skinny = CudaKernels.skinny_gemm
    monkeypatch.setattr(
        CudaKernels,
        "skinny_gemm",
        lambda self, x, w, config=None: tiles.append(self.row_invariant) or skinny(self, x, w, config),
    )
    x, wide = rand(rows, 64), rand(300, 64, scale=0.1)
    kernels = CudaKernels()
    kernels.linear(x, wide)
    assert tiles == []
    kernels.row_invariant = True
    many = kernels.linear(x, wide)
    assert all(torch.equal(kernels.linear(x[i : i + 1], wide)[0], many[i]) for i in range(rows))
    assert tiles == [True] * (rows + 1) and nmse(many, x.float() @ wide.float().T) < 1e-4


def test_row_invariant_int4_rows_past_the_fused_limit_stay_in_the_skinny_gemm(monkeypatch):
    """Int4 batches above INT4_SKINNY_MAX_ROWS take a dequantization pass and a 16-bit GEMM, which sums in another
    order; in a row-invariant graph (where the GEMV cannot take the weight) every row count stays in the fused
    skinny GEMM's 16-row tiles, so each row equals a one-row call."""
    monkeypatch.setattr(launch_module, "INT4_SKINNY_MAX_ROWS", 4)
    w = int4_quantize(torch.randn(48, 256) * 0.1, group_size=32).to(DEV)
    x = rand(20, 256)
    kernels = CudaKernels()
    kernels.gemv_max_rows = 0  # as for a weight wider than the GEMV takes
    passes = []
    dequantize = CudaKernels.int4_dequantize
    monkeypatch.setattr(
        CudaKernels, "int4_dequantize", lambda self, w, dtype: passes.append(1) or dequantize(self, w, dtype)
    )
    kernels.linear(x, w)
    assert passes == [1]
    kernels.row_invariant = True
    many = kernels.linear(x, w)
    assert all(torch.equal(kernels.linear(x[i : i + 1], w)[0], many[i]) for i in range(20)) and passes == [1]
    assert nmse(many, x.float() @ w.dequantize(torch.bfloat16).float().T) < 1e-4


@pytest.mark.parametrize("kind", ["bf16", "int4"])
@pytest.mark.parametrize("row_block", [1, 2])
def test_gemv_skips_dead_rows_that_have_programs_of_their_own(kind, row_block, monkeypatch):
    """With live (a decode-only step's context lengths), live rows get the bits of a call without it; where rows
    have programs of their own, a dead row's program writes nothing (its output and residual rows keep what the
    buffers held); where they share programs every row is computed, and a dead one (NaN in its x) cannot disturb
    a live one."""
    monkeypatch.setattr(launch_module, "gemv_row_block", lambda rows, n_out, k: row_block)
    w = torch.randn(2 * 24, 576) * 0.1
    w = (w.to(torch.bfloat16) if kind == "bf16" else int4_quantize(w, group_size=32)).to(DEV)
    x, res, w_norm = rand(5, 576), rand(5, 576), rand(576)
    live = torch.tensor([7, 8, 0, 0, 0], dtype=torch.int32, device=DEV)
    x[2:] = float("nan")
    kernels = CudaKernels()
    kernels.gemv_max_rows = 5
    want, want_res = kernels.norm_linear(x, res, w_norm, 1e-6, w, silu=True)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(-7))  # what unwritten rows keep
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: empty(t.shape, dtype=t.dtype, device=t.device).fill_(-7))
    got, got_res = kernels.norm_linear(x, res, w_norm, 1e-6, w, silu=True, live=live)
    assert torch.equal(got[:2], want[:2]) and torch.equal(got_res[:2], want_res[:2])
    untouched = slice(2, 5) if row_block == 1 else slice(5, 5)
    assert (got[untouched] == -7).all() and (got_res[untouched] == -7).all()
    assert (got[2:] == -7).sum() == got[untouched].numel() and not (want[untouched] == -7).any()


def test_gemv_row_pieces_follow_the_weight():
    """Small weights hold a row as a power-of-two piece plus the rest (SmolLM2's 576 = 512 + 64, 1,536 = 1,024 +
    512), so do int4 rows of any size and 16-bit or fp8 ones one piece would pad by more than a quarter; powers of
    two, int4 rests smaller than a group and larger 16-bit rows padded by at most a quarter keep one piece."""
    pieces = launch_module.gemv_k_pieces
    assert pieces(960, 576, 1) == (512, 64) and pieces(1152, 1536, 32) == (1024, 512)
    assert pieces(4096, 1024, 1) == (1024, 0) and pieces(1024, 3072, 1) == (4096, 0)  # Qwen3: 2^21 elements and up
    assert pieces(1024, 3072, 128) == (2048, 1024) and pieces(4096, 1024, 128) == (1024, 0)
    assert pieces(6144, 2560, 1) == (2048, 512) and pieces(6144, 2560, 128) == (2048, 512)  # Qwen3-4B
    assert pieces(960, 576, 128) == (1024, 0) and pieces(64, 256, 1) == (256, 0)
    # int4 rows past GEMV_MAX_K (the down projections of Qwen3-1.7B, 4B, 8B) take two pieces whatever their size
    assert pieces(2048, 6144, 128) == (4096, 2048) and pieces(2560, 9728, 128) == (8192, 2048)
    assert pieces(4096, 12288, 32) == (8192, 4096)


@pytest.mark.parametrize("kind", ["bf16", "int4"])
def test_rows_padded_past_a_quarter_give_the_product_in_two_pieces(kind, monkeypatch):
    """A larger weight's 320-column rows (Qwen3-4B's 2,560 scaled down) in two pieces, 256 + 64, with the larger
    weights' GEMV programs (int4: 16 rows, 8 warps): the product, 16-bit x or its int8 blocks."""
    monkeypatch.setattr(launch_module, "is_small_weight", lambda n_out, k: False)
    dense = torch.randn(48, 320) * 0.1
    w = (dense.to(torch.bfloat16) if kind == "bf16" else int4_quantize(dense, group_size=64)).to(DEV)
    x = rand(1, 320, dtype=torch.float32 if kind == "int4" else torch.bfloat16)  # fp32 out: the blocks' bits show
    group = 64 if kind == "int4" else 1
    assert launch_module.gemv_k_pieces(48, 320, group) == (256, 64)
    out = CUDA.linear(x, w)
    if kind == "int4":
        assert nmse(out, _int8_blocks_model(x, w)) < 1e-11 and CUDA._weight_kind(w)[0] == 2
    else:
        assert nmse(out, x.double() @ w.double().T) < 5e-5


@pytest.fixture
def gemv_rows(monkeypatch) -> list[int]:
    """The row count of every CudaKernels.gemv call the test makes."""
    rows = []
    gemv = CudaKernels.gemv
    monkeypatch.setattr(CudaKernels, "gemv", lambda self, x, w, **kw: rows.append(x.shape[0]) or gemv(self, x, w, **kw))
    return rows


@pytest.mark.parametrize("rows,large_gemv_rows", [(1, 1), (3, 1), (3, 3)])
def test_int4_rows_past_gemv_max_k_take_the_gemv_a_row_a_program(rows, large_gemv_rows, gemv_rows, monkeypatch):
    """Int4 rows past GEMV_MAX_K (scaled down here to 256 columns) still take the register GEMV up to
    LONG_GEMV_MAX_K columns and large_gemv_rows rows: in two pieces, a row a program, 16 rows x 4 warps; the int8
    x blocks' products and each row a one-row call's bits. More rows and longer rows go to the skinny GEMM."""
    monkeypatch.setattr(launch_module, "GEMV_MAX_K", 256)
    monkeypatch.setattr(launch_module, "is_small_weight", lambda n_out, k: False)
    w = int4_quantize(torch.randn(40, 384) * 0.1, group_size=128).to(DEV)
    x = rand(rows, 384, dtype=torch.float32)
    kernels = CudaKernels()
    kernels.large_gemv_rows = large_gemv_rows
    out = kernels.linear(x, w)
    long_gemv = rows <= large_gemv_rows
    assert gemv_rows == ([rows] if long_gemv else [])
    assert launch_module.gemv_row_block(rows, 40, 384) == 1 and launch_module.gemv_config(40, 384, 2) == (16, 4)
    assert launch_module.gemv_k_pieces(40, 384, 128) == (256, 128)
    assert all(torch.equal(kernels.linear(x[i : i + 1], w)[0], out[i]) for i in range(rows)) or not long_gemv
    assert nmse(out, _int8_blocks_model(x, w)) < (1e-11 if long_gemv else 1e-4)
    gemv_rows.clear()
    monkeypatch.setattr(launch_module, "LONG_GEMV_MAX_K", 256)
    kernels.linear(x, w)
    assert gemv_rows == []


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_long_16_bit_and_fp8_rows_take_the_gemv_for_one_row_calls(kind, gemv_rows, monkeypatch):
    """16-bit and fp8 rows past GEMV_MAX_K (scaled down here to 256 columns) take the register GEMV for calls of
    up to long_gemv_rows rows (one by default): two pieces, 2 weight rows x 4 warps. Two rows, long_gemv_rows 0
    (graphs whose verify rows share decode's route) or rows past LONG_GEMV_MAX_K go to the skinny GEMM, and only
    there does an fp8 weight take its input as fp8 rows. Both routes give the product."""
    monkeypatch.setattr(launch_module, "GEMV_MAX_K", 256)
    monkeypatch.setattr(launch_module, "is_small_weight", lambda n_out, k: False)
    dense = torch.randn(40, 384) * 0.1
    w = (dense.to(torch.bfloat16) if kind == "bf16" else fp8_quantize(dense)).to(DEV)
    x = rand(2, 384)
    want = x.double() @ (w.double() if kind == "bf16" else w.dequantize(torch.float64)).T
    kernels = CudaKernels()
    assert launch_module.gemv_config(40, 384, kernels._weight_kind(w)[0]) == (2, 4)
    assert launch_module.gemv_k_pieces(40, 384, 1) == (256, 128)
    assert not kernels._takes_fp8_rows(x[:1], w) and kernels._takes_fp8_rows(x, w) == (kind == "fp8")
    one, two = kernels.linear(x[:1], w), kernels.linear(x, w)
    assert gemv_rows == [1]
    bound = 5e-5 if kind == "bf16" else 1e-2  # fp8 rows: x rounded to fp8 a token (truncated by the interpreter)
    assert nmse(one, want[:1]) < 5e-5 and nmse(two, want) < bound  # bf16 outputs (the interpreter truncates)
    kernels.long_gemv_rows = 0
    kernels.linear(x[:1], w)
    kernels.long_gemv_rows = 1
    monkeypatch.setattr(launch_module, "LONG_GEMV_MAX_K", 256)
    kernels.linear(x[:1], w)
    assert gemv_rows == [1]


@pytest.mark.parametrize("kind", ["bf16", "fp8", "int4"])
def test_large_weights_take_the_gemv_a_row_a_program_for_large_gemv_rows_rows(kind, gemv_rows, monkeypatch):
    """Weights of LARGE_WEIGHT elements or more (scaled down here) run the GEMV a row a program (each row a
    one-row call's bits); 16-bit and fp8 ones only for calls of up to large_gemv_rows rows (then the skinny GEMM),
    int4 ones of 32-column groups (which do not meet Int8Rows) for any row count the GEMV takes."""
    monkeypatch.setattr(launch_module, "LARGE_WEIGHT", 48 * 256)
    monkeypatch.setattr(launch_module, "is_small_weight", lambda n_out, k: False)
    w = torch.randn(48, 256) * 0.1
    w = {"bf16": w.to(torch.bfloat16), "fp8": fp8_quantize(w), "int4": int4_quantize(w, group_size=32)}[kind].to(DEV)
    x = rand(3, 256)
    kernels = CudaKernels()
    assert launch_module.gemv_row_block(3, 48, 256) == 1 and launch_module.gemv_row_block(3, 47, 256) > 1
    kernels.linear(x[:1], w)
    kernels.linear(x[:2], w)
    assert gemv_rows == ([1, 2] if kind == "int4" else [1])
    kernels.large_gemv_rows = 3  # a one-sequence row-invariant graph: its verify rows too
    many = kernels.linear(x, w)
    assert gemv_rows[-1] == 3 and all(torch.equal(kernels.linear(x[i : i + 1], w)[0], many[i]) for i in range(3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled GEMV at full size needs a GPU")
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_long_rows_of_a_4b_model_give_the_product_through_either_route(kind):
    """Qwen3-4B's down projection (2,560 x 9,728) at one row: the GEMV (two pieces, 2 x 4) and the skinny GEMM it
    replaces both give x @ W.T within bf16 rounding of the float64 product."""
    dense = torch.randn(2560, 9728, device=DEV) * 0.02
    w = dense.to(torch.bfloat16) if kind == "bf16" else fp8_quantize(dense)
    x = rand(1, 9728)
    want = x.double() @ (w.double() if kind == "bf16" else w.dequantize(torch.float64)).T
    kernels = CudaKernels()
    through_gemv = kernels.linear(x, w)
    kernels.long_gemv_rows = 0
    through_skinny = kernels.linear(x, w)
    assert nmse(through_gemv, want) < 1e-5
    assert nmse(through_skinny, want) < (1e-5 if kind == "bf16" else 2e-3)  # fp8 x a token there


@pytest.fixture
def large_int4(monkeypatch):
    """Int4 weights of 48 x 256 elements and up count as large (the layers of 1.7B+ models, scaled down)."""
    monkeypatch.setattr(launch_module, "LARGE_WEIGHT", 48 * 256)
    monkeypatch.setattr(launch_module, "is_small_weight", lambda n_out, k: False)


@pytest.mark.parametrize("group", [64, 128])
def test_int8_rows_hold_each_group_as_int8_even_columns_first(group):
    """int8_quantize_rows: a group's even columns, then its odd ones, as int8 rounded at the group's largest
    magnitude / 127, with the group's scale and integer sum; a NaN or inf makes its group's scale NaN only."""
    x = rand(3, 5 * group)
    x[1, 3], x[2, group + 1] = float("nan"), float("inf")
    rows = CUDA.int8_quantize_rows(x, group)
    xi, scale, sums = _int8_rows_model(x[:1].cpu(), group)
    columns = torch.arange(5 * group).reshape(5, group)
    order = torch.cat([columns[:, 0::2], columns[:, 1::2]], 1).reshape(-1)
    off = (rows.data[0].cpu().double() - xi[0, order]).abs()  # float32 vs float64 rounding: ties may move by one
    assert off.max() <= 1 and (off > 0).sum() <= 2
    assert torch.allclose(rows.scale[0].cpu().double(), scale[0], rtol=1e-6)
    assert torch.equal(rows.sums[0].cpu(), rows.data[0].cpu().reshape(5, group).sum(1).float())
    assert torch.isnan(rows.scale[1, 0]) and torch.isnan(rows.scale[2, 1]) and torch.isfinite(rows.scale[1, 1:]).all()


@pytest.mark.parametrize(
    "group,rows,n,k",
    [(128, 2, 48, 256), (64, 9, 48, 320), (128, 12, 48, 640), (128, 16, 48, 2048), (128, 28, 512, 128)],
)
def test_large_int4_weights_meet_int8_rows_of_their_group(group, rows, n, k, large_int4):
    """Past one row (large_gemv_rows) and up to 16 rows, and the widest (gate/up: outputs >= 4 x K) up to
    INT4_SKINNY_MAX_ROWS, large int4 weights of whole 64-column groups go to the skinny GEMM with x rounded to int8
    a group at a time: it computes x_scale (s dot(q, x_int8) + o sum(x_int8)) a group, i.e. the int8 x times the
    dequantized weight (float64 model; the outputs round to bf16), any K slices."""
    w = int4_quantize(torch.randn(n, k) * 0.1, group_size=group, symmetric=group == 64).to(DEV)
    x = rand(rows, k)
    assert CUDA._takes_int8_rows(x, w) and not CUDA._takes_int8_rows(x[:1], w)
    out = CUDA.linear(x, w)
    assert nmse(out, _int8_blocks_model(x, w, group)) < 2e-5
    assert nmse(out, x.double() @ w.dequantize(torch.float64).T) < 1e-3


def test_int8_route_takes_large_int4_weights_of_64_column_groups_only(large_int4, gemv_rows):
    """One row stays in the register GEMV (large_gemv_rows: a one-sequence row-invariant graph's verify rows too);
    GGUF's 32-column groups and weights under LARGE_WEIGHT keep the widening skinny GEMM."""
    x = rand(8, 256)
    large = int4_quantize(torch.randn(48, 256), group_size=128)
    gguf = int4_quantize(torch.randn(48, 256), group_size=32)
    small = int4_quantize(torch.randn(40, 256), group_size=128)
    assert CUDA._takes_int8_rows(x, large.to(DEV))
    assert not CUDA._takes_int8_rows(x, gguf.to(DEV)) and not CUDA._takes_int8_rows(x, small.to(DEV))
    kernels = CudaKernels()
    kernels.linear(x[:1], large.to(DEV))
    kernels.linear(x[:3], large.to(DEV))
    assert gemv_rows == [1]
    kernels.large_gemv_rows = 3
    kernels.linear(x[:3], large.to(DEV))
    assert gemv_rows == [1, 3] and not kernels._takes_int8_rows(x[:3], large.to(DEV))


def test_int8_rows_from_the_norm_and_silu_equal_quantizing_after(large_int4):
    """Ahead of large int4 projections the rmsnorm and the SiLU write Int8Rows themselves: the projections'
    outputs are bit-equal to normalizing, then quantizing in a pass of its own; the first layer's norm too."""
    x, res, w_norm = rand(6, 256), rand(6, 256), rand(256)
    gate_up = int4_quantize(torch.randn(2 * 192, 256), group_size=128).to(DEV)
    down = int4_quantize(torch.randn(256, 192), group_size=64).to(DEV)
    act, new_res = CUDA.norm_linear(x, res, w_norm, 1e-6, gate_up, silu=True, feeds=down)
    assert isinstance(act, quant_module.Int8Rows) and act.group == 64
    normed, ref_res = CUDA.add_rmsnorm(x, res, w_norm, 1e-6)
    ref_act = CUDA.silu_and_mul(CUDA.linear(CUDA.int8_quantize_rows(normed, 128), gate_up))
    assert torch.equal(new_res, ref_res)
    assert torch.equal(CUDA.linear(act, down), CUDA.linear(ref_act, down))
    first, stream = CUDA.norm_linear(x, None, w_norm, 1e-6, gate_up)
    assert torch.equal(first, CUDA.linear(CUDA.rmsnorm(x, w_norm, 1e-6), gate_up)) and stream is x


def test_int8_rows_keep_each_row_as_a_one_row_call_computes_it(large_int4):
    """In a row-invariant graph (16-row tiles' config whatever the count) each row's products are a one-row
    call's bits: x's groups round per row and the integer dots are exact; a NaN row stays NaN alone."""
    kernels = CudaKernels()
    kernels.row_invariant, kernels.large_gemv_rows = True, 0
    w = int4_quantize(torch.randn(48, 512) * 0.1, group_size=128).to(DEV)
    x = rand(5, 512)
    x[3, 7] = float("nan")
    many = kernels.linear(x, w)
    for i in (0, 1, 4):
        assert torch.equal(kernels.linear(x[i : i + 1], w)[0], many[i])
    assert torch.isnan(many[3]).all() and torch.isfinite(many[[0, 1, 2, 4]]).all()


@pytest.fixture
def wide_int4(large_int4, monkeypatch):
    """Large int4 weights (scaled down) of 64+ outputs are widened as the first operand at 17-64 rows."""
    monkeypatch.setattr(launch_module, "INT4_WIDE_MIN_N", 64)


BF16, FP16 = torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    "group,rows,n,k,dtype",
    [
        (128, 17, 64, 512, BF16),
        (64, 32, 96, 320, BF16),
        (128, 40, 128, 256, FP16),
        (32, 64, 64, 384, BF16),
        (32, 20, 512, 128, BF16),
    ],
)
def test_large_int4_weights_at_17_to_64_rows_widen_as_the_first_operand(group, rows, n, k, dtype, wide_int4):
    """At 17-64 rows large int4 weights are widened to bf16 as the skinny GEMM's first operand (W_AS_A, 64 weight
    rows a program): the products of x and the bf16-rounded dequantized weight, K in slices or not, rows past a
    tile's 64 weight rows masked; x stays 16-bit (no Int8Rows), fp16 too. GGUF's 32-column groups, the widest too.
    (The interpreter's fp32 dots cost ~4e-5 here, widening x's way too; on a GPU the bound is 1e-5: below.)"""
    w = int4_quantize(torch.randn(n, k) * 0.1, group_size=group).to(DEV)
    x = rand(rows, k, dtype=dtype)
    assert CUDA._wide_int4(x, w) and not CUDA._takes_int8_rows(x, w)
    want = x.double() @ w.dequantize(dtype).double().T
    assert nmse(CUDA.linear(x, w), want) < 1e-4


def test_wide_int4_route_leaves_what_it_does_not_win(wide_int4, monkeypatch):
    """Up to 16 rows, the widest weights meeting Int8Rows up to 32 rows, small weights, weights of fewer than
    INT4_WIDE_MIN_N outputs and row-invariant graphs keep their routes."""
    large = int4_quantize(torch.randn(64, 256), group_size=128).to(DEV)
    widest = int4_quantize(torch.randn(1024, 256), group_size=128).to(DEV)
    assert CUDA._wide_int4(rand(17, 256), large) and not CUDA._wide_int4(rand(16, 256), large)
    assert not CUDA._wide_int4(rand(65, 256), large)
    assert not CUDA._wide_int4(rand(32, 256), widest) and CUDA._takes_int8_rows(rand(32, 256), widest)
    assert CUDA._wide_int4(rand(33, 256), widest)
    assert not CUDA._wide_int4(rand(20, 256), int4_quantize(torch.randn(40, 256), group_size=128).to(DEV))
    monkeypatch.setattr(launch_module, "INT4_WIDE_MIN_N", 128)
    assert not CUDA._wide_int4(rand(20, 256), large) and not CUDA._wide_int4(rand(40, 256), large)
    assert CUDA._takes_int8_rows(rand(20, 256), large)
    kernels = CudaKernels()
    kernels.row_invariant = True
    assert not kernels._wide_int4(rand(20, 256), large)


@pytest.mark.parametrize("rows,serial", [(17, True), (32, True), (33, False), (64, False)])
def test_wide_int4_gemm_starts_after_its_producer_up_to_32_rows(rows, serial, wide_int4, monkeypatch):
    """Up to INT4_WIDE_SERIAL_ROWS rows the wide route's GEMM is launched without programmatic dependent launch
    (it starts once its producer has finished); above, and for the other skinny GEMMs, with it where it is on."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **options: launches.append(options)

    monkeypatch.setattr(kernels_module, "_skinny_gemm_kernel", Recorder())
    kernels = CudaKernels(pdl=True)
    large = int4_quantize(torch.randn(64, 256), group_size=128).to(DEV)
    x = rand(rows, 256)
    assert kernels._wide_int4(x, large)
    kernels.skinny_gemm(x, large)
    kernels.skinny_gemm(x, large.dequantize(torch.bfloat16))
    assert [(o["PDL"], o["launch_pdl"]) for o in launches] == [(not serial, not serial), (True, True)]


def test_silu_ahead_of_a_wide_int4_down_projection_writes_16_bit_rows(wide_int4):
    """Where the down projection is widened as the first operand, the SiLU hands it 16-bit rows, not Int8Rows,
    and the step's output is the 16-bit SiLU's through that projection."""
    x, res, w_norm = rand(20, 256), rand(20, 256), rand(256)
    gate_up = int4_quantize(torch.randn(2 * 192, 256), group_size=128).to(DEV)
    down = int4_quantize(torch.randn(256, 192), group_size=64).to(DEV)
    act, _ = CUDA.norm_linear(x, res, w_norm, 1e-6, gate_up, silu=True, feeds=down)
    assert isinstance(act, torch.Tensor) and act.shape == (20, 192)
    normed, _ = CUDA.add_rmsnorm(x, res, w_norm, 1e-6)
    assert torch.equal(act, CUDA.silu_and_mul(CUDA.linear(normed, gate_up)))


def test_int4_wide_config_follows_the_weight():
    cfg = launch_module.int4_wide_config
    assert cfg(12288, 2048, 64, 128) == (64, 128, 2, 2) and cfg(24576, 4096, 40, 128) == (64, 128, 2, 2)  # gate/up
    assert cfg(2560, 9728, 64, 128) == (64, 256, 3, 2) and cfg(4096, 4096, 20, 128) == (64, 256, 3, 2)  # down, o
    assert cfg(6144, 2560, 64, 128) == (64, 256, 3, 1) and cfg(6144, 2560, 32, 128) == (64, 256, 3, 2)  # qkv
    assert cfg(4096, 2048, 64, 128) == (64, 256, 3, 2)  # 1.7B's qkv: 64 tiles of outputs, so K in two slices
    assert cfg(1024, 576, 64, 32) == (64, 64, 3, 2)  # steps halved to whole groups that divide K
    assert cfg(256, 96, 64, 64) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled GEMM at full size needs a GPU")
@pytest.mark.parametrize("n,k,rows", [(2560, 9728, 48), (19456, 2560, 64), (6144, 4096, 24)])
def test_wide_int4_at_full_size_gives_the_product(n, k, rows):
    """Qwen3-4B's down and gate/up, 8B's qkv at 24-64 rows through the wide route: x times the bf16-rounded
    dequantized weight (the pass + bf16 GEMM's products) within fp32 summation of the float64 product."""
    w = int4_quantize(torch.randn(n, k, device=DEV) * 0.02, group_size=128)
    x = rand(rows, k)
    kernels = CudaKernels()
    assert kernels._wide_int4(x, w)
    assert nmse(kernels.linear(x, w), x.double() @ w.dequantize(torch.bfloat16).double().T) < 1e-5


def test_int4_int8_config_follows_the_weight():
    cfg = launch_module.int4_int8_config
    assert cfg(24576, 4096, 4, 128) == (64, 128, 3, 1) and cfg(19456, 2560, 4, 128) == (32, 128, 4, 1)  # gate/up
    assert cfg(4096, 12288, 8, 128) == (32, 512, 3, 2) and cfg(2560, 9728, 8, 128) == (32, 256, 3, 2)  # down
    assert cfg(2560, 4096, 2, 128) == (32, 512, 3, 1) and cfg(6144, 4096, 16, 128) == (32, 256, 3, 2)  # o, qkv
    # 17-32 rows: one config for every weight (1.7B's gate/up and down at 24 / 32 rows), steps halved to divide K
    assert cfg(12288, 2048, 24, 128) == (64, 256, 3, 2) and cfg(2048, 6144, 32, 128) == (64, 256, 3, 2)
    assert cfg(1024, 384, 24, 128) == (64, 128, 3, 2)
    assert cfg(96, 320, 4, 64) == (32, 64, 3, 2)  # steps halved to a group that divides K (skinny_gemm: one slice)


SCALED_MM_ROWS = pytest.param(
    80,
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._scaled_mm needs an fp8 GPU"),
    ],
)


@pytest.mark.parametrize("rows", [8, SCALED_MM_ROWS])  # the skinny fp8 GEMM; torch._scaled_mm past its rows
def test_fp8_rows_from_the_norm_and_silu_equal_quantizing_after(rows):
    """At batch sizes past the register GEMV, the rmsnorm and the SiLU ahead of an fp8 projection write per-token
    fp8 rows themselves: the projections' outputs are bit-equal to normalizing, then quantizing in a pass of its
    own."""
    x, res, w_norm = rand(rows, 256), rand(rows, 256), rand(256)
    gate_up, down = fp8_quantize(torch.randn(2 * 64, 256)).to(DEV), fp8_quantize(torch.randn(32, 64)).to(DEV)
    act, new_res = CUDA.norm_linear(x, res, w_norm, 1e-6, gate_up, silu=True, feeds=down)
    assert isinstance(act, quant_module.Fp8Rows)
    normed, ref_res = CUDA.add_rmsnorm(x, res, w_norm, 1e-6)
    ref_act = CUDA.silu_and_mul(CUDA.linear(normed, gate_up))
    assert torch.equal(new_res, ref_res)
    assert torch.equal(CUDA.linear(act, down), CUDA.linear(ref_act, down))
    first, stream = CUDA.norm_linear(x, None, w_norm, 1e-6, gate_up)  # the first layer: x is the residual
    assert torch.equal(first, CUDA.linear(CUDA.rmsnorm(x, w_norm, 1e-6), gate_up)) and stream is x


def test_spec_accept_counts_only_steps_that_carried_drafts():
    """A verify row whose history had no n-gram (n_draft 0) is a step but not a draft, as the engine's own
    drafter counts: stats are steps, drafts, drafted, accepted, then accepted per position."""
    k = 2
    sampled = torch.tensor([5, 6, 7, 8, 9, 10], device=DEV)  # the target's tokens at each row's 3 positions
    ids = torch.tensor([1, 0, 0, 2, 8, 4], device=DEV)  # row 1 drafts 8 (== the sample: accepted), then 4 (!= 9)
    hist = torch.zeros(2, 8, dtype=torch.int64, device=DEV)
    ntok = torch.tensor([3, 3], device=DEV)
    cap = torch.tensor([8, 8], device=DEV)
    n_draft = torch.tensor([0, 2], dtype=torch.int32, device=DEV)
    stats = torch.zeros(2, drafting.SPEC_STAT_FIELDS + k, dtype=torch.int64, device=DEV)
    DeviceNgramDrafter(CUDA, k).accept(sampled, ids, hist, ntok, cap, n_draft, stats, no_stops(2))
    assert stats.tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 2, 1, 1, 0]]
    assert ntok.tolist() == [4, 5] and hist[0, 3].item() == 5 and hist[1, 3:5].tolist() == [8, 9]


def no_stops(rows):
    return torch.full((rows, drafting.SPEC_STOP_IDS), -1, dtype=torch.int64, device=DEV)


def test_spec_accept_ends_a_row_at_its_stop_token():
    """The samples extend the history up to the row's first stop token, which ends the row (cap = history length:
    the chunk's later steps skip it); accepted drafts past it do not count. A row without that stop token, or
    with no stop tokens (ignore_eos), takes every accepted draft."""
    k = 3
    sampled = torch.tensor([7, 8, 2, 9] * 3, device=DEV)  # each row: drafts 7, 8, 2 accepted, then 9; 2 is EOS
    ids = torch.tensor([1, 7, 8, 2] * 3, device=DEV)
    hist = torch.zeros(3, 16, dtype=torch.int64, device=DEV)
    ntok, cap = torch.tensor([4, 4, 4], device=DEV), torch.tensor([16, 16, 16], device=DEV)
    n_draft = torch.tensor([3, 3, 3], dtype=torch.int32, device=DEV)
    stats = torch.zeros(3, drafting.SPEC_STAT_FIELDS + k, dtype=torch.int64, device=DEV)
    stops = no_stops(3)
    stops[0, :2] = torch.tensor([0, 2])
    stops[1, 0] = 5  # a stop token the row does not sample
    DeviceNgramDrafter(CUDA, k).accept(sampled, ids, hist, ntok, cap, n_draft, stats, stops)
    assert ntok.tolist() == [7, 8, 8] and cap.tolist() == [7, 16, 16]
    assert hist[0, 4:8].tolist() == [7, 8, 2, 0] and hist[1, 4:8].tolist() == [7, 8, 2, 9]
    assert stats[0].tolist() == [1, 1, 3, 2, 1, 1, 0] and stats[1].tolist() == [1, 1, 3, 3, 1, 1, 1]
