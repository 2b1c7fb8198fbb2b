"""Comparing a backend's output with the reference: NMSE, non-finite agreement and where the error sits."""

import math
from dataclasses import dataclass

import torch

_KINDS = ("finite", "nan", "+inf", "-inf")


@dataclass
class Comparison:
    nmse: float
    fault: str | None  # a disagreement no NMSE bound excuses: shape, or NaN/Inf in another place or sign
    where: str  # human pointer at the largest error, for the failure message
    gain: float = 1.0  # least-squares factor out ≈ gain * ref: a systematic scale error moves it off 1
    gain_sigma: float = 0.0  # its standard error from the residual noise (rounding averages out, a bias does not)


def _kind(x: torch.Tensor) -> torch.Tensor:
    kind = torch.zeros_like(x, dtype=torch.int8)
    kind[torch.isnan(x)] = 1
    kind[x == math.inf] = 2
    kind[x == -math.inf] = 3
    return kind


def _index(flat: int, shape) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(shape)))


def nonfinite_fault(out: torch.Tensor, ref: torch.Tensor) -> str | None:
    """NaN and ±Inf must appear exactly where the reference has them, with the same sign."""
    k_out, k_ref = _kind(out), _kind(ref)
    bad = (k_out != k_ref).flatten()
    if not bad.any():
        return None
    first = int(bad.nonzero()[0])
    idx = _index(first, out.shape)
    got, want = out.flatten()[first].item(), ref.flatten()[first].item()
    return (
        f"{int(bad.sum())} of {bad.numel()} elements disagree on NaN/Inf; first at index {idx}: "
        f"got {got:g} ({_KINDS[int(k_out.flatten()[first])]}), reference {want:g}"
    )


def compare(out: torch.Tensor, ref: torch.Tensor) -> Comparison:
    if tuple(out.shape) != tuple(ref.shape):
        return Comparison(math.nan, f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}", "")
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    fault = nonfinite_fault(o, r)
    both = torch.isfinite(o) & torch.isfinite(r)
    err = torch.where(both, (o - r) ** 2, torch.zeros_like(o))
    power = torch.where(torch.isfinite(r), r**2, torch.zeros_like(r)).sum()
    total = float(err.sum())
    nmse = total / float(power) if float(power) > 0 else total
    gain, sigma = _gain(o, r, both)
    return Comparison(nmse, fault, _where(o, r, err, _kind(o) != _kind(r)), gain, sigma)


def _gain(o: torch.Tensor, r: torch.Tensor, both: torch.Tensor) -> tuple[float, float]:
    """Least-squares gain of `o` on `r` over the elements finite in both, and its standard error: the larger of
    the independent-elements estimate and the one from the spread of row gains (errors within a row are
    correlated: in a linear, one token's quantized activations reach all of its outputs)."""
    o, r = torch.where(both, o, 0.0), torch.where(both, r, 0.0)
    rr = float((r * r).sum())
    n = int(both.sum())
    if rr == 0 or n < 2:
        return 1.0, 0.0
    gain = float((o * r).sum()) / rr
    sigma = math.sqrt(float(((o - gain * r) ** 2 * both).sum()) / rr / n)
    if o.dim() >= 2 and o.shape[0] >= 4:
        weight = (r * r).flatten(1).sum(1)
        rows = weight > 0
        row_gain = (o * r).flatten(1).sum(1)[rows] / weight[rows]
        sigma = max(sigma, math.sqrt(float((weight[rows] ** 2 * (row_gain - gain) ** 2).sum())) / rr)
    return gain, sigma


def _where(o: torch.Tensor, r: torch.Tensor, err: torch.Tensor, nonfinite_mismatch: torch.Tensor) -> str:
    parts = []
    if float(err.sum()) > 0:
        worst = int(err.flatten().argmax())
        parts.append(
            f"worst at index {_index(worst, o.shape)}: got {o.flatten()[worst].item():.6g}, "
            f"reference {r.flatten()[worst].item():.6g}"
        )
    if o.dim() >= 2:
        # Rows (tokens) that are grossly wrong: points at skipped, misplaced or NaN-filled rows.
        row_err = err.flatten(1).sum(1)
        row_pow = torch.where(torch.isfinite(r), r**2, torch.zeros_like(r)).flatten(1).sum(1).clamp_min(1e-300)
        bad = (row_err / row_pow > 1e-2) | nonfinite_mismatch.flatten(1).any(1)
        rows = bad.nonzero().flatten().tolist()
        if rows:
            shown = ", ".join(str(i) for i in rows[:8]) + (" ..." if len(rows) > 8 else "")
            parts.append(f"{len(rows)} of {o.shape[0]} rows are off by more than 1% or in NaN/Inf (rows {shown})")
    return "; ".join(parts)
