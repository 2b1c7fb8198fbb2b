"""FP8 validity of the FNUZ formats (AMD gfx942) on the CPU: torch has both dtypes here. FNUZ has no inf and one
NaN (byte 0x80, where OCP keeps negative zero), and an out-of-range cast gives NaN: the codecs must saturate."""

import pytest
import torch

from flashnext.core.errors import UserError
from flashnext.core.precision import (
    FP8_FORMATS,
    PRECISIONS,
    Fp8Weight,
    concat_rows,
    fp8_quantize,
    fp8_quantize_per_token,
    validate_weight,
)

FNUZ = [FP8_FORMATS[torch.float8_e4m3fnuz], FP8_FORMATS[torch.float8_e5m2fnuz]]
IDS = [f.name for f in FNUZ]


def test_format_table_matches_torch():
    for fmt in FP8_FORMATS.values():
        assert fmt.max == torch.finfo(fmt.dtype).max
        nan_bytes = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float().isnan().nonzero().flatten().tolist()
        assert tuple(nan_bytes) == fmt.nan_bytes
        has_inf = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float().isinf().any().item()
        assert has_inf == fmt.has_inf
    assert [(f.max, f.has_inf, f.nan_bytes) for f in FNUZ] == [(240.0, False, (0x80,)), (57344.0, False, (0x80,))]


def no_nan_bytes(data: torch.Tensor) -> bool:
    return not (data.view(torch.uint8) == 0x80).any()


@pytest.mark.parametrize("fmt", FNUZ, ids=IDS)
def test_out_of_range_and_huge_weights_saturate_never_nan(fmt):
    torch.manual_seed(0)
    w = torch.randn(8, 64) * torch.tensor([1e-3, 1, 100, 240, 241, 6e4, 1e30, 3e38]).unsqueeze(1)
    q = fp8_quantize(w, fmt.precision, dtype=fmt.dtype)
    assert q.data.dtype == fmt.dtype and no_nan_bytes(q.data) and torch.isfinite(q.data.float()).all()
    assert (q.data.float().abs().amax(dim=1) == fmt.max).all()  # each row's largest lands on the maximum
    validate_weight("w", q)
    # per tensor: rows far below the largest one go subnormal or to zero, never NaN
    t = fp8_quantize(w, fmt.precision, per_channel=False, dtype=fmt.dtype)
    assert no_nan_bytes(t.data) and t.data.float().abs().max() == fmt.max


@pytest.mark.parametrize("fmt", FNUZ, ids=IDS)
def test_plus_minus_max_round_trip_exactly(fmt):
    w = torch.tensor([[fmt.max, -fmt.max, 0.0, fmt.max / 2]])
    q = fp8_quantize(w, fmt.precision, dtype=fmt.dtype)
    assert q.scale.item() == 1.0 and q.dequantize().tolist() == w.tolist()


@pytest.mark.parametrize("fmt", FNUZ, ids=IDS)
def test_nan_bait_just_past_max_and_negative_zero(fmt):
    """Values whose scaled form rounds just above the maximum, and -0.0 (0x80 is NaN in FNUZ)."""
    w = torch.tensor([[fmt.max * (1 + 1e-7), -fmt.max * (1 + 2e-7), -0.0, 1e-45]])
    q = fp8_quantize(w, fmt.precision, dtype=fmt.dtype)
    assert no_nan_bytes(q.data) and torch.isfinite(q.dequantize()).all()
    x, scale = fp8_quantize_per_token(torch.tensor([[-0.0, -1e-40, 3.0]]), fmt.precision, dtype=fmt.dtype)
    assert no_nan_bytes(x) and torch.isfinite(x.float()).all() and scale.item() == pytest.approx(3.0 / fmt.max)


@pytest.mark.parametrize("fmt", FNUZ, ids=IDS)
def test_subnormal_range_keeps_finite_and_signs(fmt):
    tiny = torch.finfo(fmt.dtype).tiny  # the smallest normal
    w = torch.tensor([[tiny, tiny / 2, tiny / 4, -tiny / 8, fmt.max]])
    q = fp8_quantize(w, fmt.precision, dtype=fmt.dtype)
    back = q.dequantize()
    assert no_nan_bytes(q.data) and torch.isfinite(back).all()
    assert back[0, 0] == tiny and back[0, 1] == tiny / 2 and back[0, 3] <= 0


@pytest.mark.parametrize("fmt", FNUZ, ids=IDS)
def test_all_zero_weights_and_activations(fmt):
    q = fp8_quantize(torch.zeros(4, 32), fmt.precision, dtype=fmt.dtype)
    assert (q.data.view(torch.uint8) == 0).all() and (q.scale == 1).all() and (q.dequantize() == 0).all()
    x, scale = fp8_quantize_per_token(torch.zeros(3, 16), fmt.precision, dtype=fmt.dtype)
    assert (x.view(torch.uint8) == 0).all() and (scale == 1).all()


@pytest.mark.parametrize("fmt, bound", [(FNUZ[0], 2.0**-4), (FNUZ[1], 2.0**-3)], ids=IDS)
def test_round_trip_error_bound(fmt, bound):
    """Rounding to nearest: at most half a step, 2^-(mantissa bits + 1) of a normal value's magnitude."""
    torch.manual_seed(1)
    w = torch.randn(64, 256)
    q = fp8_quantize(w, fmt.precision, dtype=fmt.dtype)
    back = q.dequantize()
    normal = back.abs() >= torch.finfo(fmt.dtype).tiny * q.scale
    rel = ((back - w).abs() / w.abs())[normal]
    assert rel.max() <= bound * (1 + 1e-6)
    x = torch.randn(16, 256) * 50
    xq, xs = fp8_quantize_per_token(x, fmt.precision, dtype=fmt.dtype)
    assert ((xq.float() * xs - x).abs() <= bound * x.abs() + torch.finfo(fmt.dtype).tiny * xs).all()


@pytest.mark.parametrize("fmt", FNUZ, ids=IDS)
def test_activation_codec_saturates_inf_and_keeps_nan_lone(fmt):
    x = torch.tensor([[1.0, float("inf"), -float("inf"), 2.0], [1.0, float("nan"), 4.0, 1e30]])
    xq, scale = fp8_quantize_per_token(x, fmt.precision, dtype=fmt.dtype)
    back = xq.float() * scale
    assert back[0].tolist() == [1.0, 2.0, -2.0, 2.0]  # inf saturates at the row's finite maximum
    assert back[1, 1].isnan() and torch.isfinite(back[1, [0, 2, 3]]).all()  # NaN stays NaN, alone


def test_precision_stored_as_fnuz_quantizes_and_requantizes_ocp_checkpoints():
    e4m3 = PRECISIONS["fp8-e4m3"].stored_as(torch.float8_e4m3fnuz)
    assert e4m3.name == "fp8-e4m3" and PRECISIONS["fp8-e4m3"].storage_dtype == torch.float8_e4m3fn
    w = torch.randn(16, 32) * 300
    q = e4m3.quantize(w)
    assert q.data.dtype == torch.float8_e4m3fnuz and q.fmt == "fp8-e4m3" and q.format.max == 240.0
    assert e4m3.quantize(q) is q
    ocp = fp8_quantize(w, "fp8-e4m3")  # as an fp8 checkpoint stores it
    moved = e4m3.quantize(ocp)
    assert moved.data.dtype == torch.float8_e4m3fnuz
    torch.testing.assert_close(moved.dequantize(), w, atol=0, rtol=2**-3)
    assert concat_rows([q, e4m3.quantize(w[:4])]).data.dtype == torch.float8_e4m3fnuz


def test_mismatched_storage_is_refused():
    with pytest.raises(UserError, match="cannot store fp8-e4m3"):
        PRECISIONS["fp8-e4m3"].stored_as(torch.float8_e5m2fnuz)
    with pytest.raises(UserError, match="only fp8 precisions"):
        PRECISIONS["bf16"].stored_as(torch.float8_e4m3fnuz)


def test_validation_uses_the_formats_own_maximum():
    ok = Fp8Weight(torch.full((2, 2), 240.0).to(torch.float8_e4m3fnuz), torch.ones(2, 1))
    validate_weight("ok", ok)
    nan = Fp8Weight(torch.tensor([[0x80, 0x01]], dtype=torch.uint8).view(torch.float8_e4m3fnuz), torch.ones(1, 1))
    with pytest.raises(UserError, match="'bad': 1 of 2 float8_e4m3fnuz values are inf/NaN or outside ±240"):
        validate_weight("bad", nan)


def test_fp8_linear_rounds_activations_to_the_weights_own_format(monkeypatch):
    from flashnext.plugins.rocm.routes import fp8_linear

    seen = {}

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        seen.update(a=a.dtype, b=b.dtype, scale_a=tuple(scale_a.shape), scale_b=tuple(scale_b.shape))
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    torch.manual_seed(2)
    w = PRECISIONS["fp8-e4m3"].stored_as(torch.float8_e4m3fnuz).quantize(torch.randn(32, 64))
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    out = fp8_linear(x, w)
    assert seen == {"a": torch.float8_e4m3fnuz, "b": torch.float8_e4m3fnuz, "scale_a": (5, 1), "scale_b": (1, 32)}
    reference = x.float() @ w.dequantize().t()
    assert out.dtype == torch.bfloat16 and ((out.float() - reference).norm() / reference.norm()) < 0.06
