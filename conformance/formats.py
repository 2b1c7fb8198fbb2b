"""FP8 formats the suite knows, by torch dtype: what saturation, subnormals and NaN look like in each.

A backend declares a format by the storage dtype of the Precision its check_request returns for fp8-e4m3 /
fp8-e5m2, so a ROCm backend storing float8_e4m3fnuz gets the FNUZ cases without a change here.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    dtype: torch.dtype
    max: float
    mantissa_bits: int
    smallest_subnormal: float
    nan_bytes: frozenset[int]  # bit patterns that read as NaN
    inf_bytes: frozenset[int]  # bit patterns that read as ±inf (none for fn / fnuz)

    def non_finite_bytes(self) -> frozenset[int]:
        return self.nan_bytes | self.inf_bytes


FP8_FORMATS = {
    f.dtype: f
    for f in (
        Fp8Format(torch.float8_e4m3fn, 448.0, 3, 2.0**-9, frozenset({0x7F, 0xFF}), frozenset()),
        Fp8Format(
            torch.float8_e5m2,
            57344.0,
            2,
            2.0**-16,
            frozenset({0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}),
            frozenset({0x7C, 0xFC}),
        ),
        Fp8Format(torch.float8_e4m3fnuz, 240.0, 3, 2.0**-10, frozenset({0x80}), frozenset()),
        Fp8Format(torch.float8_e5m2fnuz, 57344.0, 2, 2.0**-17, frozenset({0x80}), frozenset()),
    )
}
