"""Every numeric bound of the conformance suite, in one table (rendered into docs/conformance.md).

Op bounds are NMSE = mse(out, ref) / mse(ref, 0) against the core reference run in float64 on the same (already
rounded) inputs, so they measure only what the backend's kernel adds. Columns for fp8 / int4 assume bf16 activations
(the precision's suggested activation dtype) and allow dynamic per-token activation quantization in FP8 linears.
"""

from dataclasses import dataclass

PRECISION_NAMES = ("fp32", "bf16", "fp16", "fp8-e4m3", "fp8-e5m2", "int4")


@dataclass(frozen=True)
class Bound:
    metric: str
    at_most: bool  # True: value <= bound passes; False: value >= bound passes
    by_precision: dict[str, float]
    why: str

    def limit(self, precision: str) -> float:
        return self.by_precision[precision]

    def passes(self, value: float, precision: str) -> bool:
        limit = self.limit(precision)
        if value != value:  # NaN never passes
            return False
        return value <= limit if self.at_most else value >= limit


def _row(fp32, bf16, fp16, e4m3, e5m2, int4) -> dict[str, float]:
    return dict(zip(PRECISION_NAMES, (fp32, bf16, fp16, e4m3, e5m2, int4)))


EXACT = _row(0, 0, 0, 0, 0, 0)


def _by_dtype(fp32: float, bf16: float, fp16: float) -> dict[str, float]:
    """An op without weights computes in the activation dtype: the fp8 / int4 columns repeat bf16's (their
    suggested activation dtype); the suite looks bounds up by the dtype a backend really uses."""
    return _row(fp32, bf16, fp16, bf16, bf16, bf16)


# Derived by conformance/calibrate.py (docs/conformance.md, "How the bounds were derived"): 3 x the largest error
# of the CPU and H200 reference kernels, rounded up to 1-2-5, at least 1e-10 in fp32.
THRESHOLDS: dict[str, Bound] = {
    "embedding": Bound("nmse", True, EXACT, "a row copy: nothing to round"),
    "rmsnorm": Bound("nmse", True, _by_dtype(1e-10, 1e-5, 2e-7), "fp32 statistics, one output rounding"),
    "add_rmsnorm": Bound("nmse", True, _by_dtype(1e-10, 2e-5, 5e-7), "both outputs (normed, residual sum) are checked"),
    "rope": Bound("nmse", True, _by_dtype(1e-10, 1e-5, 2e-7), "fp32 rotation, one output rounding"),
    "silu_and_mul": Bound("nmse", True, _by_dtype(1e-10, 5e-5, 5e-7), "one output rounding of a product"),
    "store_kv": Bound(
        "nmse", True, EXACT, "a cast into the cache dtype; slots outside slot_mapping must stay untouched"
    ),
    "attention": Bound(
        "nmse",
        True,
        _by_dtype(1e-10, 2e-5, 5e-7),
        "fp32 softmax; bf16 kernels may round the probabilities once; contexts up to 4200 keys",
    ),
    "linear": Bound(
        "nmse",
        True,
        _row(1e-10, 2e-5, 5e-7, 5e-3, 5e-5, 1e-4),
        "vs the dequantized weight; fp32 excludes TF32; fp8-e4m3 allows per-token fp8 activations (W8A8);"
        " fp8-e5m2 as observed, 16-bit activations (W8A16)",
    ),
    "gain": Bound(
        "|gain - 1|",
        True,
        _row(1e-5, 2.5e-3, 1e-3, 2.5e-3, 2.5e-3, 2.5e-3),
        "every op comparison: out ≈ gain x ref (least squares); the bound is the larger of this and 5"
        " standard errors of the gain (rounding averages out, a systematic scale does not)",
    ),
    "sample_tv": Bound(
        "total variation", True, _row(*[0.06] * 6), "seeded sampling frequencies over 4000 rows vs softmax(logits / T)"
    ),
    "engine_logits": Bound(
        "nmse",
        True,
        _row(1e-8, 1e-3, 1e-4, 2e-2, 8e-2, 1e-3),
        "tiny model's prompt logits vs the reference engine with the same quantized weights",
    ),
    "step_logits": Bound(
        "nmse",
        True,
        _row(1e-8, 1e-3, 1e-4, 2e-2, 8e-2, 1e-3),
        "engine invariants: logits behind each token of two runs that must agree (chunked vs not,"
        " batched vs alone, prefix hit vs miss...), compared until their tokens part",
    ),
    "quantized_path_used": Bound(
        "nmse ratio",
        False,
        _row(0, 0, 0, 0.25, 0.25, 0.25),
        "distance to the fp32 model / the quantized reference's distance to it:"
        " near 0 means the backend silently kept full-precision weights",
    ),
    "logits_vs_fp32": Bound(
        "nmse",
        True,
        _row(1e-8, 2e-3, 2e-4, 4e-2, 0.15, 0.25),
        "the end-to-end effect of the precision on the tiny model's logits",
    ),
    "e2e_greedy_agreement": Bound(
        "share of clear steps",
        False,
        _row(1, 1, 1, 0.9, 0.9, 0.9),
        "default model, the CPU's 16 greedy tokens on three prompts fed to both: the"
        " backend's argmax where the CPU's top-2 margin is clear (thresholds.CLEAR_MARGIN)",
    ),
    "e2e_perplexity": Bound(
        "relative difference",
        True,
        _row(0.005, 0.02, 0.01, 0.05, 0.1, 0.02),
        "perplexity of a fixed Shakespeare passage vs the CPU backend (default model)",
    ),
}


# e2e_greedy_agreement judges a step when the CPU fp32 top-2 logit margin exceeds this: more than the precision's
# rounding moves the lead of the top token on the default model (calibrate.py --e2e, docs/conformance.md), so
# disagreeing there is a fault, not a tie.
CLEAR_MARGIN = {"fp32": 0.01, "bf16": 2.0, "fp16": 0.2, "fp8-e4m3": 20.0, "fp8-e5m2": 20.0, "int4": 2.0}


def render_markdown() -> str:
    """The threshold table as markdown; docs/conformance.md embeds this text (a test keeps them equal)."""
    head = "| case | metric | pass when | " + " | ".join(PRECISION_NAMES) + " | why |"
    rule = "| --- " * (len(PRECISION_NAMES) + 4) + "|"
    rows = [head, rule]
    for key, b in THRESHOLDS.items():
        cells = " | ".join(f"{b.limit(p):g}" for p in PRECISION_NAMES)
        rows.append(f"| `{key}` | {b.metric} | {'≤' if b.at_most else '≥'} | {cells} | {b.why} |")
    return "\n".join(rows) + "\n"
