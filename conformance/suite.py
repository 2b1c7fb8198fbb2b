"""The conformance cases: run by `flashnext conformance` (or `pytest --pyargs flashnext.conformance.suite`).

Every kernel of the backend under test is compared with the core reference computed in higher precision on the
same inputs, for each precision the backend declares; then precision validity, engine invariants, capability
honesty and (slow) end-to-end numbers on the default model. Bounds live in thresholds.py.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from flashnext.conformance import harness
from flashnext.conformance.checks import compare
from flashnext.conformance.data import GREEDY_PROMPTS, SHAKESPEARE
from flashnext.conformance.formats import FP8_FORMATS
from flashnext.conformance.pytest_plugin import Recorder, backend_under_test
from flashnext.conformance.thresholds import CLEAR_MARGIN, THRESHOLDS
from flashnext.core.backend import declares
from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.errors import UserError
from flashnext.core.kernels import AttentionMetadata, ReferenceKernels, SamplingTensors
from flashnext.core.precision import (
    FP8_DTYPES,
    FP8_MAX,
    PRECISIONS,
    Fp8Weight,
    Int4Weight,
    fp8_quantize,
    fp8_quantize_per_token,
    int4_from_gguf,
    int4_quantize,
    pack_int4,
    unpack_int4,
    validate_weight,
)

REF = ReferenceKernels()
QUANTIZED = ("fp8-e4m3", "fp8-e5m2", "int4")
FEATURES = ("chunked_prefill", "cuda_graphs", "spec_decode")


def pytest_generate_tests(metafunc):
    """`precision` runs over what the backend declares; `undeclared` over what it must refuse."""
    if "precision" in metafunc.fixturenames:
        metafunc.parametrize("precision", list(backend_under_test(metafunc.config).precisions))
    if "fp8" in metafunc.fixturenames:
        declared = backend_under_test(metafunc.config).precisions
        metafunc.parametrize("fp8", [p for p in FP8_MAX if p in declared])
    if "undeclared" in metafunc.fixturenames:
        declared = backend_under_test(metafunc.config).precisions
        metafunc.parametrize("undeclared", [p for p in PRECISIONS if p not in declared] + ["fp4"])


@pytest.fixture(scope="session")
def backend(request):
    return backend_under_test(request.config)


@pytest.fixture(scope="session")
def seed(request) -> int:
    return request.config.getoption("--flashnext-seed")


@pytest.fixture
def conformance(request, backend) -> Recorder:
    return Recorder(request.node, backend.name)


# ---------------------------------------------------------------------------------------------------------------
# helpers


class Setup:
    """What a case needs to call the backend: its kernels, activation dtype, device and a seeded generator."""

    def __init__(self, backend, precision: str, seed: int, case: str):
        p = PRECISIONS[precision]
        self.kernels, self.dtype, self.device = backend.kernels(p), backend.activation_dtype(p), backend.device()
        # Ops without weights are bounded by the dtype they compute in, whatever the weights' precision is.
        self.bound = DTYPE_BOUND.get(self.dtype, precision)
        # Fresh inputs per case (never zeros), reproducible from --flashnext-seed and the case name.
        self.gen = torch.Generator().manual_seed(seed * 1_000_003 + sum(map(ord, case)) * 7919)

    def randn(self, *shape, std=1.0, dtype=None) -> torch.Tensor:
        """Random values rounded to the activation dtype, on the CPU (the reference reads these exact values)."""
        x = torch.randn(*shape, generator=self.gen) * std
        return x.to(dtype or self.dtype)

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device).clone()

    def poison(self, shape, dtype=None) -> None:
        """Leave NaN-filled freed memory in the allocator, so an output the kernel never writes shows up as NaN."""
        dtype = dtype or self.dtype
        for _ in range(2):
            junk = torch.full(tuple(shape), float("nan"), dtype=dtype, device=self.device)
            del junk


DTYPE_BOUND = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def record(conformance, key, precision, out, ref, label="", bound_as=None) -> bool:
    """NMSE against the bound, plus a systematic-scale check no NMSE bound can hide: a 0.5% gain is 2.5e-5 of
    NMSE, within the rounding of an FP8 linear, but it does not average out the way rounding does."""
    c = compare(out, ref)
    fault = c.fault or gain_fault(c, bound_as or precision)
    return conformance.check(key, precision, c.nmse, label=label, detail=c.where, fault=fault, bound_as=bound_as)


def gain_fault(c, precision: str) -> str | None:
    limit = max(THRESHOLDS["gain"].limit(precision), 5 * c.gain_sigma)
    if c.gain != c.gain or abs(c.gain - 1) <= limit:
        return None
    return f"systematic scale error: the output is {c.gain:.5f} x the reference (allowed 1 ± {limit:.2g})"


def kv_dtypes(backend, setup: Setup) -> list[torch.dtype]:
    """The activation dtype, plus FP8 caches where the backend declares an FP8 KV cache."""
    extra = [FP8_DTYPES["fp8-e4m3"], FP8_DTYPES["fp8-e5m2"]] if declares(backend, "fp8_kv_cache") else []
    return [setup.dtype] + extra


def block_size(backend) -> int:
    return backend.profiles()[backend.default_profile].block_size


# ---------------------------------------------------------------------------------------------------------------
# op cases


def test_embedding(backend, conformance, precision, seed):
    s = Setup(backend, precision, seed, "embedding")
    weight = s.randn(1000, 130)
    ids = torch.randint(0, 1000, (37,), generator=s.gen)
    ids[5] = ids[11]  # repeated ids
    weight[ids[3], :3] = torch.tensor([float("nan"), float("inf"), -float("inf")]).to(weight.dtype)
    s.poison((37, 130))
    out = s.kernels.embedding(s.on_device(ids), s.on_device(weight))
    record(conformance, "embedding", precision, out, F.embedding(ids, weight.double()), bound_as=s.bound)


NORM_SHAPES = [(1, 64), (5, 130), (33, 576), (9, 4, 64)]


@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rmsnorm(backend, conformance, precision, seed, shape):
    s = Setup(backend, precision, seed, f"rmsnorm{shape}")
    x, w = s.randn(*shape, std=3.0), s.randn(shape[-1], std=0.2) + 1
    if shape == (5, 130):
        x[2, 7] = float("nan")  # the whole row becomes NaN, no other row
    if shape == (33, 576):
        edge_rows(x)
    s.poison(shape)
    out = s.kernels.rmsnorm(s.on_device(x), s.on_device(w), 1e-6)
    record(conformance, "rmsnorm", precision, out, REF.rmsnorm(x.double(), w.double(), 1e-6), bound_as=s.bound)


def edge_rows(x: torch.Tensor, large: float = 1e4) -> None:
    """Row 0 all zeros; row 1 at magnitudes whose squares overflow fp16 (statistics must not run in 16 bits)."""
    x[0] = 0
    x[1] = (x[1].float() / x[1].float().abs().amax() * large).to(x.dtype)


@pytest.mark.parametrize("shape", NORM_SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_add_rmsnorm(backend, conformance, precision, seed, shape):
    s = Setup(backend, precision, seed, f"add_rmsnorm{shape}")
    x, res, w = s.randn(*shape), s.randn(*shape, std=2.0), s.randn(shape[-1], std=0.2) + 1
    if shape == (33, 576):
        edge_rows(x)
        res[0] = 0  # a row whose sum is zero too
    s.poison(shape)
    normed, summed = s.kernels.add_rmsnorm(s.on_device(x), s.on_device(res), s.on_device(w), 1e-6)
    ref_normed, ref_summed = REF.add_rmsnorm(x.double(), res.double(), w.double(), 1e-6)
    record(conformance, "add_rmsnorm", precision, normed, ref_normed, "normed", bound_as=s.bound)
    record(conformance, "add_rmsnorm", precision, summed, ref_summed, "residual", bound_as=s.bound)


def rope_table(head_dim: int, max_pos: int = 4096, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim", [(1, 4, 2, 64), (13, 4, 2, 64), (40, 9, 3, 128), (7, 8, 8, 32)]
)
def test_rope(backend, conformance, precision, seed, tokens, heads, kv_heads, head_dim):
    s = Setup(backend, precision, seed, f"rope{tokens}{heads}{kv_heads}{head_dim}")
    q, k = s.randn(tokens, heads, head_dim), s.randn(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4000, (tokens,), generator=s.gen)  # unsorted, as a mixed batch has them
    positions[0] = 0
    table = rope_table(head_dim)
    s.poison(q.shape)
    out_q, out_k = s.kernels.rope(s.on_device(q), s.on_device(k), s.on_device(positions), s.on_device(table))
    ref_q, ref_k = REF.rope(q.double(), k.double(), positions, table.double())
    record(conformance, "rope", precision, out_q, ref_q, "q", bound_as=s.bound)
    record(conformance, "rope", precision, out_k, ref_k, "k", bound_as=s.bound)


def test_store_kv(backend, conformance, precision, seed):
    s = Setup(backend, precision, seed, "store_kv")
    bs, blocks, kv_heads, head_dim, tokens = block_size(backend), 9, 2, 64, 23
    slots = torch.randperm(blocks * bs, generator=s.gen)[:tokens]
    slots[[4, 10, 17]] = -1  # padding tokens: written nowhere
    k, v = s.randn(tokens, kv_heads, head_dim), s.randn(tokens, kv_heads, head_dim)
    for dtype in kv_dtypes(backend, s):
        # Poison: every slot starts NaN; afterwards exactly the mapped slots may hold numbers.
        k_cache = torch.full((blocks, bs, kv_heads, head_dim), float("nan"), dtype=dtype)
        v_cache = k_cache.clone()
        dev_k, dev_v = s.on_device(k_cache), s.on_device(v_cache)
        REF.store_kv(k, v, k_cache, v_cache, slots)
        ref_k, ref_v = k_cache.double(), v_cache.double()
        s.kernels.store_kv(s.on_device(k), s.on_device(v), dev_k, dev_v, s.on_device(slots))
        for name, got, want in (("k", dev_k, ref_k), ("v", dev_v, ref_v)):
            c = compare(got.double(), want)
            conformance.check(
                "store_kv",
                precision,
                c.nmse,
                label=f"{name} cache {str(dtype).removeprefix('torch.')}",
                detail=_slot_report(got, slots),
                fault=c.fault,
                bound_as=s.bound,
            )


def _slot_report(cache: torch.Tensor, slots: torch.Tensor) -> str:
    written = ~torch.isnan(cache.double().cpu()).flatten(0, 1).flatten(1).all(dim=1)
    wanted = torch.zeros_like(written)
    wanted[slots[slots >= 0]] = True
    missed = (wanted & ~written).nonzero().flatten().tolist()
    extra = (~wanted & written).nonzero().flatten().tolist()
    return f"slots in slot_mapping left unwritten: {missed[:8]}; slots outside slot_mapping overwritten: {extra[:8]}"


# (query lengths, context lengths, heads, kv heads, head dim); lengths may be functions of the block size. The long
# cases cross the split-KV and tile edges of real kernels (1k, 2k, 4k keys) and hold block tables of more than 256
# entries; their head counts stay small so the CPU suite keeps its time budget.
ATTENTION_CASES = {
    "prefill": ([7], [7], 4, 4, 64),
    "decode-gqa": ([1, 1, 1], [1, 17, 40], 8, 2, 64),
    "ragged-chunks": ([5, 1, 16, 3], [5, 33, 50, 19], 6, 2, 128),
    "verify-long-mqa": ([3, 1], [300, 129], 4, 1, 32),
    "single-token": ([1], [1], 4, 2, 64),
    "full-block-boundary-hit": (lambda b: [b, b, 1], lambda b: [b, 2 * b, b + 1], 4, 2, 64),
    "zero-and-sharp-queries": ([9], [9], 4, 2, 64),
    "decode-split-kv-4k": ([1, 1, 1, 1], [4096, 2049, 2047, 1025], 2, 1, 64),
    "chunk-past-2k": ([32, 1], [2100, 4200], 4, 1, 64),
}


def _blocks(lengths, bs: int) -> list[int]:
    return lengths(bs) if callable(lengths) else lengths


def paged_inputs(s: Setup, query_lens, context_lens, kv_heads, head_dim, bs, dtype):
    """Caches with shuffled block tables; every slot not inside a context stays NaN (a kernel must not read it)."""
    blocks_each = [-(-c // bs) for c in context_lens]
    num_blocks = sum(blocks_each) + 3
    order = torch.randperm(num_blocks, generator=s.gen).tolist()
    tables = torch.full((len(context_lens), max(blocks_each)), -1, dtype=torch.int32)
    k_cache = torch.full((num_blocks, bs, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    slots = []
    for i, (q_len, ctx) in enumerate(zip(query_lens, context_lens)):
        mine = [order.pop() for _ in range(blocks_each[i])]
        tables[i, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
        seq_slots = torch.tensor([mine[p // bs] * bs + p % bs for p in range(ctx)])
        k_cache.view(-1, kv_heads, head_dim)[seq_slots] = s.randn(ctx, kv_heads, head_dim).to(dtype)
        v_cache.view(-1, kv_heads, head_dim)[seq_slots] = s.randn(ctx, kv_heads, head_dim).to(dtype)
        slots += seq_slots[ctx - q_len :].tolist()
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start=torch.tensor(starts, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        query_lens_host=tuple(query_lens),
        context_lens_host=tuple(context_lens),
    )
    return k_cache, v_cache, meta


def meta_to(meta: AttentionMetadata, device) -> AttentionMetadata:
    moved = {f: getattr(meta, f).to(device) for f in ("slot_mapping", "query_start", "context_lens", "block_tables")}
    return AttentionMetadata(
        **moved,
        max_query_len=meta.max_query_len,
        max_context_len=meta.max_context_len,
        query_lens_host=meta.query_lens_host,
        context_lens_host=meta.context_lens_host,
    )


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention(backend, conformance, precision, seed, case):
    s = Setup(backend, precision, seed, f"attention{case}")
    query_lens, context_lens, heads, kv_heads, head_dim = ATTENTION_CASES[case]
    bs = block_size(backend)
    query_lens, context_lens = _blocks(query_lens, bs), _blocks(context_lens, bs)
    for dtype in kv_dtypes(backend, s):
        k_cache, v_cache, meta = paged_inputs(s, query_lens, context_lens, kv_heads, head_dim, bs, dtype)
        # std 2: scores spread like a trained model's, so a softmax temperature off by 0.5% shows in the output
        q = s.randn(sum(query_lens), heads, head_dim, std=2.0)
        if case == "zero-and-sharp-queries":
            q[0] = 0  # a uniform average of the values
            q[4] = q[4] * 30  # scores in the hundreds: softmax without its max subtracted overflows
        scale = head_dim**-0.5
        s.poison(q.shape)
        out = s.kernels.attention(
            s.on_device(q), s.on_device(k_cache), s.on_device(v_cache), meta_to(meta, s.device), scale
        )
        ref = REF.attention(q.double(), k_cache.double(), v_cache.double(), meta, scale)
        record(
            conformance,
            "attention",
            precision,
            out,
            ref,
            f"cache {str(dtype).removeprefix('torch.')}",
            bound_as=s.bound,
        )


LINEAR_SHAPES = [(1, 128, 96, False), (7, 256, 320, True), (33, 128, 200, False)]


def linear_weights(precision: str, w: torch.Tensor) -> dict[str, object]:
    """The stored forms of one weight that `precision` covers: every FP8 scale layout, several INT4 groupings."""
    if precision in FP8_MAX:
        return {
            "per-channel": fp8_quantize(w, precision, per_channel=True),
            "per-tensor": fp8_quantize(w, precision, per_channel=False),
        }
    if precision == "int4":
        return {"g32-sym": int4_quantize(w, 32, symmetric=True), "g128-asym": int4_quantize(w, 128, symmetric=False)}
    return {"dense": PRECISIONS[precision].quantize(w)}


@pytest.mark.parametrize("tokens,k,n,bias", LINEAR_SHAPES, ids=lambda v: str(v))
def test_linear(backend, conformance, precision, seed, tokens, k, n, bias):
    s = Setup(backend, precision, seed, f"linear{tokens}{k}{n}")
    x = s.randn(tokens, k)
    if tokens > 4:
        x[3] = float("nan")  # a NaN token row stays a NaN row and leaks nowhere else
        x[0] = 0  # an all-zero row (a per-token scale of 0 must not turn it into NaN)
    b = s.randn(n, std=0.5) if bias else None
    for label, w in linear_weights(precision, torch.randn(n, k, generator=s.gen) * 0.05).items():
        s.poison((tokens, n))
        out = s.kernels.linear(s.on_device(x), w.to(s.device), None if b is None else s.on_device(b))
        ref = REF.linear(x.double(), w, None if b is None else b.double())
        record(conformance, "linear", precision, out, ref, label)


@pytest.mark.parametrize("fmt", ["fp8-e4m3", "fp8-e5m2"])
def test_linear_fp8_activation_range(backend, conformance, seed, fmt):
    """Activations far beyond the FP8 range: a backend must scale them, never overflow its FP8 cast to inf."""
    if fmt not in backend.precisions:
        pytest.skip(f"backend '{backend.name}' does not declare {fmt}")
    s = Setup(backend, fmt, seed, f"linear-range{fmt}")
    amax = 6e4 if s.dtype == torch.float16 else 1e5
    x = s.randn(9, 128)
    outliers = torch.randint(0, 128, (9,), generator=s.gen)
    x[torch.arange(9), outliers] = torch.tensor([amax, -amax] * 5)[:9].to(s.dtype)  # one outlier per token
    w = fp8_quantize(torch.randn(64, 128, generator=s.gen) * 0.05, fmt)
    s.poison((9, 64))
    out = s.kernels.linear(s.on_device(x), w.to(s.device))
    record(conformance, "linear", fmt, out, REF.linear(x.double(), w), f"activations ±{amax:g}")


@pytest.mark.parametrize("shape", [(1, 256), (9, 260), (33, 3072)], ids=lambda s: "x".join(map(str, s)))
def test_silu_and_mul(backend, conformance, precision, seed, shape):
    s = Setup(backend, precision, seed, f"silu{shape}")
    x = s.randn(*shape, std=2.0)
    if shape == (9, 260):
        x[1, 3] = float("nan")  # gate NaN -> NaN
        x[4, 130 + 8] = float("inf")  # up +inf -> ±inf with the sign of silu(gate)
    if shape == (33, 3072):
        edge_rows(x, large=100.0)  # gates of ±100: a naive exp(-x) overflows
    s.poison((shape[0], shape[1] // 2))
    out = s.kernels.silu_and_mul(s.on_device(x))
    record(conformance, "silu_and_mul", precision, out, REF.silu_and_mul(x.double()), bound_as=s.bound)


def sampling(rows: int, device, temperature=0.0, top_k=0, top_p=1.0, seeds=None) -> SamplingTensors:
    seeds = torch.arange(rows, dtype=torch.int64) * 7919 + 17 if seeds is None else seeds
    return SamplingTensors(
        temperature=torch.full((rows,), temperature, dtype=torch.float32, device=device),
        top_k=torch.full((rows,), top_k, dtype=torch.int64, device=device),
        top_p=torch.full((rows,), top_p, dtype=torch.float32, device=device),
        noise_seed=seeds.to(device),
        all_greedy=temperature == 0,
    )


def test_sample(backend, conformance, seed):
    p = backend.default_precision
    s = Setup(backend, p, seed, "sample")
    dev, kernels = s.device, s.kernels
    logits = torch.randn(64, 1000, generator=s.gen) * 3
    greedy = kernels.sample(logits.to(dev), sampling(64, dev)).cpu()
    mixed = sampling(64, dev, temperature=0.8)
    mixed.temperature[::2] = 0.0  # greedy rows inside a sampled batch
    in_mixed = kernels.sample(logits.to(dev), mixed).cpu()
    want = logits.argmax(-1)
    wrong = int((greedy != want).sum() + (in_mixed[::2] != want[::2]).sum())
    conformance.expect(wrong == 0, p, "greedy", f"{wrong} greedy rows are not the argmax")

    # Distribution: 4000 rows of the same logits; frequencies must follow softmax(logits / T).
    small = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    rows = 4000
    drawn = kernels.sample(small.repeat(rows, 1).to(dev), sampling(rows, dev, temperature=0.7)).cpu()
    freq = torch.bincount(drawn, minlength=8).double() / rows
    tv = 0.5 * float((freq - torch.softmax(small.double() / 0.7, -1)).abs().sum())
    conformance.check("sample_tv", p, tv, "temperature 0.7")

    again = kernels.sample(small.repeat(rows, 1).to(dev), sampling(rows, dev, temperature=0.7)).cpu()
    conformance.expect(
        bool((again == drawn).all()), p, "same seeds same tokens", "sampling is not a function of the seeds"
    )
    last_seeds = sampling(rows, "cpu").noise_seed[-100:]
    part = kernels.sample(small.repeat(100, 1).to(dev), sampling(100, dev, temperature=0.7, seeds=last_seeds)).cpu()
    conformance.expect(
        bool((part == drawn[-100:]).all()),
        p,
        "batch independent",
        "a row's sample changes with the other rows in the batch",
    )

    top = kernels.sample(logits.to(dev), sampling(64, dev, temperature=1.5, top_k=3)).cpu()
    outside = int((~(logits.topk(3, dim=-1).indices == top.unsqueeze(1)).any(-1)).sum())
    conformance.expect(outside == 0, p, "top_k 3", f"{outside} of 64 samples fall outside the top 3")
    nucleus = kernels.sample(logits.to(dev), sampling(64, dev, temperature=1.0, top_p=0.6)).cpu()
    probs = torch.softmax(logits.double(), -1)
    sorted_p, order = probs.sort(-1, descending=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < 0.6 + 1e-6
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    outside = int((~keep.gather(1, nucleus.unsqueeze(1))).sum())
    conformance.expect(outside == 0, p, "top_p 0.6", f"{outside} of 64 samples fall outside the 0.6 nucleus")


# ---------------------------------------------------------------------------------------------------------------
# FP8 through the backend's own code: the Precision its check_request returns quantizes the weights (the engine
# stores what it returns), its linear quantizes activations. Cases per format the backend declares (formats.py).


def _backend_fp8(backend, fp8: str):
    profile = backend.profiles()[backend.default_profile].overridden(**harness.plain_profile())
    precision = backend.check_request(fp8, profile)
    return precision, FP8_FORMATS.get(precision.storage_dtype)


def _edge_weight_rows(fmt, g) -> dict[str, torch.Tensor]:
    """Rows of one [R, 256] weight, each an edge a quantizer can get wrong."""
    n = 256

    def randn(std=1.0):
        return torch.randn(n, generator=g) * std

    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    subnormal = randn(1e-5)
    subnormal[7] = 1.0  # one element sets the scale; the rest land among the format's subnormals
    outlier = randn(0.01)
    outlier[100] = 100.0
    return {
        "normal": randn(0.05),
        "out of range": randn(fmt.max * 1e3),
        "±max": signs * fmt.max,
        "NaN bait": signs * fmt.max * (1 + 2.0 ** -(fmt.mantissa_bits + 1)),
        "subnormals": subnormal,
        "one outlier": outlier,
        "all zero": torch.zeros(n),
        "1e-30 tiny": randn(1e-30),
    }


def _half_steps(w: torch.Tensor, q, fmt) -> torch.Tensor:
    """|dequantized - w| in half steps of the format's grid at each element (<= 1 for round-to-nearest)."""
    scale = q.scale.float().cpu().expand_as(w)
    v = (w / scale).abs()
    exponent = torch.floor(torch.log2(v.clamp_min(fmt.smallest_subnormal * 2**fmt.mantissa_bits)))
    step = torch.maximum(2.0 ** (exponent - fmt.mantissa_bits), torch.tensor(fmt.smallest_subnormal))
    back = q.data.float().cpu() * scale
    return (back - w).abs() / (step * scale / 2)


def test_fp8_weights_through_backend(backend, conformance, fp8, seed):
    """The backend's quantizer on out-of-range, ±max, NaN-bait, subnormal and all-zero rows: finite bytes only,
    finite non-zero scales, every element within half a step of the format's grid."""
    precision, fmt = _backend_fp8(backend, fp8)
    if not conformance.expect(
        fmt is not None,
        fp8,
        "known format",
        f"stores {fp8} as {precision.storage_dtype}, a dtype formats.py does not describe",
    ):
        return
    rows = _edge_weight_rows(fmt, torch.Generator().manual_seed(seed))
    w = torch.stack(list(rows.values()))
    q = precision.quantize(w.to(backend.device()))
    if not conformance.expect(
        isinstance(q, Fp8Weight) and q.data.dtype == fmt.dtype,
        fp8,
        "stored as fp8",
        f"quantize returned {type(q).__name__} {getattr(q, 'dtype', '')}, not {fmt.dtype}",
    ):
        return
    bad_bytes = torch.isin(
        q.data.cpu().view(torch.uint8), torch.tensor(sorted(fmt.non_finite_bytes()), dtype=torch.uint8)
    )
    scale = q.scale.float().cpu()
    steps = _half_steps(w, q, fmt)
    for i, label in enumerate(rows):
        row_scale = scale[i if scale.shape[0] > 1 else 0]
        nonfinite = int(bad_bytes[i].sum())
        worst = float(steps[i].nan_to_num(nan=math.inf).amax())
        problem = (
            f"{nonfinite} of 256 bytes are NaN/inf in {fmt.dtype}"
            if nonfinite
            else f"scale {float(row_scale):g} is not finite and positive"
            if not (torch.isfinite(row_scale).all() and (row_scale > 0).all())
            else f"an element is {worst:.3g} half-steps from its value (round to nearest: <= 1); "
            "no saturation or a flushed subnormal"
            if worst > 1.001
            else None
        )
        conformance.expect(problem is None, fp8, f"{label} row", f"the backend's {fp8} quantizer: {problem}")


def test_fp8_linear_edges(backend, conformance, fp8, seed):
    """The backend's linear on activation rows at the edges of the format: zero, tiny, exactly ±max, just past
    max (an unscaled cast makes NaN or inf of it), far past it, and a NaN row (which must stay a lone NaN row)."""
    s = Setup(backend, fp8, seed, f"fp8-edges{fp8}")
    precision, fmt = _backend_fp8(backend, fp8)
    if fmt is None:
        pytest.skip(f"{fp8} is stored as {precision.storage_dtype}: see fp8_weights_through_backend")
    k = 128
    top = min(fmt.max * 1.2, torch.finfo(s.dtype).max * 0.9)
    signs = torch.where(torch.rand(k, generator=s.gen) < 0.5, -1.0, 1.0)
    far = torch.randn(k, generator=s.gen)
    far[5] = min(1e5, torch.finfo(s.dtype).max * 0.9)
    nan_row = torch.randn(k, generator=s.gen)
    nan_row[9] = float("nan")
    rows = {
        "normal": torch.randn(k, generator=s.gen),
        "all zero": torch.zeros(k),
        "tiny": torch.randn(k, generator=s.gen) * 1e-6,
        "±max": signs * fmt.max,
        "past max": signs * top,
        "far past max": far,
        "NaN": nan_row,
    }
    x = torch.stack(list(rows.values())).to(s.dtype)
    w = precision.quantize(torch.randn(64, k, generator=s.gen) * 0.05)
    s.poison((len(rows), 64))
    out = s.kernels.linear(s.on_device(x), w.to(s.device)).double().cpu()
    ref = REF.linear(x.double(), w.to("cpu"))
    for i, label in enumerate(rows):
        c = compare(out[i], ref[i])
        conformance.check("linear", fp8, c.nmse, label=f"{label} row", detail=c.where, fault=c.fault)


# ---------------------------------------------------------------------------------------------------------------
# precision validity (core formats every backend reads)


@pytest.mark.parametrize("fmt", ["fp8-e4m3", "fp8-e5m2"])
def test_fp8_format(backend, conformance, fmt):
    fmax, dtype = FP8_MAX[fmt], FP8_DTYPES[fmt]
    exact = torch.tensor([0.5, -1.0, 1.75, 3.0, -fmax, fmax, 2.0**-6])
    conformance.expect(
        bool((exact.to(dtype).float() == exact).all()),
        fmt,
        "round trip",
        f"representable values do not survive a {fmt} round trip",
    )
    tiny = 2.0**-9 if fmt == "fp8-e4m3" else 2.0**-16  # the smallest subnormal
    conformance.expect(
        float(torch.tensor([tiny]).to(dtype).float()) == tiny,
        fmt,
        "subnormal",
        f"the smallest {fmt} subnormal {tiny:g} is flushed",
    )

    w = torch.randn(16, 64) * 1e3
    w[2, 5] = 5e30  # finite, far beyond the range
    q = fp8_quantize(w, fmt, per_channel=True)
    data = q.data.float()
    conformance.expect(bool(torch.isfinite(data).all()), fmt, "finite from finite", "finite input produced inf/NaN")
    conformance.expect(
        float(data.abs().amax(1).min()) == fmax,
        fmt,
        "saturation at ±max",
        f"each row's amax must land on ±{fmax:g}, got {data.abs().amax(1).tolist()[:4]}",
    )
    amax = w.abs().amax(1, keepdim=True)
    conformance.expect(torch.allclose(q.scale, amax / fmax, rtol=1e-6), fmt, "scale from amax", "scale != amax / max")
    back = q.dequantize()
    rel = float(((back - w).abs() / w.abs().clamp_min(float(q.scale.max()) * 2.0**-9)).amax())
    step = 2.0**-3 if fmt == "fp8-e4m3" else 2.0**-2
    conformance.expect(rel <= step, fmt, "round-trip error", f"relative error {rel:.3g} exceeds half a step")

    x = torch.tensor([[1.0, float("nan"), -2.0, float("inf"), 3e38]])
    data, scale = fp8_quantize_per_token(x, fmt)
    vals = (data.float() * scale)[0]
    conformance.expect(
        bool(torch.isnan(vals[1])) and bool(torch.isfinite(vals[[0, 2, 4]]).all()),
        fmt,
        "NaN propagates alone",
        f"expected NaN only at index 1, got {vals.tolist()}",
    )
    conformance.expect(float(vals[3]) > 0, fmt, "inf saturates", f"+inf must saturate to +max, got {float(vals[3])}")


def test_weight_validator(backend, conformance):
    good = fp8_quantize(torch.randn(8, 32), "fp8-e4m3")
    cases = {
        "NaN in fp8 data": Fp8Weight(
            good.data.clone().view(torch.uint8).index_fill_(1, torch.tensor([3]), 0x7F).view(torch.float8_e4m3fn),
            good.scale,
        ),
        "zero fp8 scale": Fp8Weight(good.data, torch.zeros_like(good.scale)),
        "inf fp8 scale": Fp8Weight(good.data, torch.full_like(good.scale, float("inf"))),
        "inf dense": torch.tensor([[1.0, float("inf")]]),
        "NaN int4 scale": Int4Weight(
            good.data.view(torch.uint8)[:, :16].clone(), torch.full((8, 1), float("nan")), torch.zeros(8, 1), 32
        ),
        "dense beyond e4m3 for an unscaled cast": torch.tensor([[500.0, 1.0]]),
    }
    conformance.expect(
        _validates(good, "fp8-e4m3"), "fp8-e4m3", "valid weight accepted", "a valid FP8 weight was refused"
    )
    for label, w in cases.items():
        fmt = "fp8-e4m3" if "e4m3" in label else None
        precision = "int4" if "int4" in label else "fp8-e4m3" if "fp8" in label or fmt else "fp32"
        conformance.expect(not _validates(w, fmt), precision, f"refuses {label}", f"validate_weight accepted {label}")


def _validates(w, fmt) -> bool:
    try:
        validate_weight("w", w, fmt)
        return True
    except UserError:
        return False


def test_int4_format(backend, conformance, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (4, 64), generator=g, dtype=torch.uint8)
    q[0, :16] = torch.arange(16, dtype=torch.uint8)
    conformance.expect(torch.equal(unpack_int4(pack_int4(q)), q), "int4", "pack/unpack exact", "unpack(pack(q)) != q")
    w = torch.randn(48, 256, generator=g)
    for group in (32, 64, 128):
        for symmetric in (True, False):
            qw = int4_quantize(w, group, symmetric)
            err = (qw.dequantize() - w).abs().view(48, -1, group)
            half_step = qw.scales.unsqueeze(-1) / 2 * (1 + 1e-5)
            worst = float((err / half_step).amax())
            conformance.expect(
                worst <= 1.0,
                "int4",
                f"g{group}-{'sym' if symmetric else 'asym'} error bound",
                f"error reaches {worst:.3g} half-steps (bound: 1)",
            )


def test_quantized_on_the_device(backend, conformance, seed):
    """The engine quantizes projections at load on the backend's device: its bytes, scales and offsets must be the
    CPU's, or the same checkpoint holds other weights on another device."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g).exp()
    w[0, :3] = torch.tensor([1e-30, 3e4, -7.0])
    for precision in [p for p in ("int4", "fp8-e4m3", "fp8-e5m2") if p in backend.precisions]:
        here, there = PRECISIONS[precision].quantize(w), PRECISIONS[precision].quantize(w.to(backend.device()))
        differ = [
            f
            for f in ("packed", "scales", "offsets", "data", "scale")
            if hasattr(here, f)
            and not torch.equal(getattr(here, f).view(torch.uint8), getattr(there, f).cpu().view(torch.uint8))
        ]
        conformance.expect(
            not differ,
            precision,
            "same as the CPU",
            f"{', '.join(differ)} differ from the CPU's quantization of the same weight",
        )


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1"])
def test_gguf_q4(backend, conformance, seed, ggml_type):
    """GGUF blocks decoded by int4_from_gguf equal the gguf package's own dequantization bit for bit."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    qtype = getattr(GGMLQuantizationType, ggml_type)
    w = (torch.randn(6, 96, generator=torch.Generator().manual_seed(seed)) * 0.3).numpy()
    raw = quants.quantize(w, qtype)
    want = torch.from_numpy(np.asarray(quants.dequantize(raw, qtype), dtype=np.float32))
    got = int4_from_gguf(raw, ggml_type, (6, 96)).dequantize()
    diff = float((got - want).abs().max())
    conformance.expect(
        diff == 0.0, "int4", f"{ggml_type} decode", f"decoded values differ from gguf's by up to {diff:g}"
    )


# ---------------------------------------------------------------------------------------------------------------
# engine: precision honesty (the FP8 three-step check, and its INT4 twin) and invariants


@pytest.fixture(scope="session")
def tiny():
    return harness.tiny_model()


@pytest.fixture(scope="session")
def reference_logits(tiny):
    """Prompt logits of the reference engine per precision, computed once."""
    cache = {}
    ref = harness.ReferenceBackend()

    def get(precision: str) -> torch.Tensor:
        if precision not in cache:
            engine = harness.make_engine(ref, tiny, precision, **harness.plain_profile())
            cache[precision] = torch.cat([harness.prompt_logits(engine, p) for p in harness.tiny_prompts(2, 1)])
        return cache[precision]

    return get


def _nmse(a, b) -> float:
    return compare(a, b).nmse


def test_engine_precision(backend, conformance, precision, tiny, reference_logits):
    """Declared precisions must run, store weights in that format, and produce logits of that precision."""
    engine = harness.make_engine(backend, tiny, precision, **harness.plain_profile())
    conformance.expect(
        engine.precision.name == precision,
        precision,
        "engine precision",
        f"asked for {precision}, the engine runs {engine.precision.name}",
    )
    stored = _stored_weight_problem(backend, engine.model, precision)
    conformance.expect(stored is None, precision, "weights stored and valid", stored or "")
    logits = torch.cat([harness.prompt_logits(engine, p) for p in harness.tiny_prompts(2, 1)])
    want, fp32 = reference_logits(precision), reference_logits("fp32")
    c = compare(logits, want)
    if c.fault or not THRESHOLDS["engine_logits"].passes(c.nmse, precision):
        c.where = "; ".join(filter(None, [c.where, first_divergent_op(backend, tiny, precision)]))
    conformance.check("engine_logits", precision, c.nmse, "vs reference", detail=c.where, fault=c.fault)
    # Non-finite logits make every distance below meaningless: name that, not a precision the backend lacks.
    nonfinite = (
        None if bool(torch.isfinite(logits).all()) else "the logits hold NaN/Inf (see engine_logits::vs reference)"
    )
    if precision in QUANTIZED:
        own, expected = _nmse(logits, fp32), _nmse(want, fp32)
        conformance.check(
            "quantized_path_used",
            precision,
            own / expected,
            "vs fp32 model",
            fault=nonfinite,
            detail=""
            if nonfinite
            else f"the logits are {own:.2g} from the fp32 model's while {precision} weights put them "
            f"{expected:.2g} away: the backend computes with full-precision weights, not {precision}",
        )
    conformance.check("logits_vs_fp32", precision, _nmse(logits, fp32), "end to end", fault=nonfinite)


# Which arguments of each op are activations (cast to the backend's dtype when a reference call is replayed).
_ACTIVATION_ARGS = {
    "embedding": (1,),
    "rmsnorm": (0, 1),
    "add_rmsnorm": (0, 1, 2),
    "rope": (0, 1),
    "store_kv": (0, 1, 2, 3),
    "attention": (0, 1, 2),
    "linear": (0, 1, 2),
    "silu_and_mul": (0,),
}


def first_divergent_op(backend, tiny, precision: str) -> str:
    """Replay the reference engine's op calls on one prompt through the backend's kernels, each on the reference's
    own inputs (so errors do not accumulate), and name the first op whose output leaves its bound."""
    ref_engine = harness.make_engine(harness.ReferenceBackend(), tiny, precision, **harness.plain_profile())
    tape = harness.KernelTape(ref_engine.model.kernels)
    ref_engine.model.kernels = tape
    harness.prompt_logits(ref_engine, harness.tiny_prompts(1, 1)[0])
    p = backend.check_request(
        precision, backend.profiles()[backend.default_profile].overridden(**harness.plain_profile())
    )
    kernels, dtype, device = backend.kernels(p), backend.activation_dtype(p), backend.device()
    bound = DTYPE_BOUND.get(dtype, precision)
    layer = 0
    for i, (op, args) in enumerate(tape.calls):
        mine = [
            a.to(dtype) if j in _ACTIVATION_ARGS[op] and isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for j, a in enumerate(args)
        ]
        moved = [
            meta_to(a, device) if isinstance(a, AttentionMetadata) else a.to(device) if hasattr(a, "to") else a
            for a in mine
        ]
        got = getattr(kernels, op)(*moved)
        if op == "store_kv":  # its result is the caches it wrote
            want, got = _stored(mine), (moved[2], moved[3])
        else:
            want = getattr(REF, op)(
                *[
                    a.double()
                    if j in _ACTIVATION_ARGS[op] and isinstance(a, torch.Tensor) and a.is_floating_point()
                    else a
                    for j, a in enumerate(mine)
                ]
            )
        for w, g in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
            c = compare(g, w)
            limit = THRESHOLDS[op].limit(precision if op == "linear" else bound)
            if c.fault or c.nmse > limit:
                return (
                    f"replaying the reference's ops, the first to leave its bound is call {i} ({op}, layer {layer}): "
                    f"{c.fault or f'nmse {c.nmse:.3g} > {limit:g}'}"
                )
        layer += op == "attention"
    return (
        "every op, replayed alone on the reference's inputs, is within its bound: the fault is in how they are "
        "composed or stored (the backend's weight storage, its model runner, or the engine)"
    )


def _stored(args) -> tuple[torch.Tensor, torch.Tensor]:
    k, v, k_cache, v_cache, slots = args
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    REF.store_kv(k, v, k_cache, v_cache, slots)
    return k_cache.double(), v_cache.double()


def _stored_weight_problem(backend, model, precision: str) -> str | None:
    """What is wrong with how the backend stores the projections (Backend.stored_weights), or None."""
    stored = backend.stored_weights(model)
    if not stored:
        return "the backend reports no stored projection weights (Backend.stored_weights)"
    for where, s in stored.items():
        check = _native_problem if s.form == "native" else _grid_problem
        problem = check(where, s, precision)
        if problem:
            return problem
    return None


def _native_problem(where: str, s, precision: str) -> str | None:
    kind = {"int4": Int4Weight, "fp8-e4m3": Fp8Weight, "fp8-e5m2": Fp8Weight}.get(precision, torch.Tensor)
    w = s.weight
    if not isinstance(w, kind):
        return f"{where} is stored as {type(w).__name__}, not {kind.__name__}"
    if isinstance(w, torch.Tensor) and w.dtype != PRECISIONS[precision].storage_dtype:
        return f"{where} is stored as {w.dtype}, not {PRECISIONS[precision].storage_dtype}"
    try:
        validate_weight(
            where,
            w.to("cpu") if not isinstance(w, torch.Tensor) else w.cpu(),
            precision if precision in FP8_MAX else None,
        )
    except UserError as exc:
        return str(exc)
    return None


def _grid_problem(where: str, s, precision: str) -> str | None:
    """A wider float tensor declared to hold exactly the precision's values: int4 values on a 16-level grid in each
    group of `group_size` columns, 16-bit values that survive a round trip through their dtype."""
    w = s.weight.detach().cpu()
    if precision in FP8_MAX or not w.is_floating_point() or not bool(torch.isfinite(w).all()):
        return f"{where}: a {precision} weight reported as grid values must be a finite float tensor (fp8: native)"
    if precision != "int4":
        storage = PRECISIONS[precision].storage_dtype
        off = int((w.to(storage).to(w.dtype) != w).sum())
        return f"{where}: {off} of {w.numel()} values are not {storage} values" if off else None
    n, k = w.shape
    g = s.group_size
    if not g or k % g:
        return f"{where}: int4 grid values need a group_size dividing K={k}, got {g}"
    groups = w.double().reshape(n, k // g, g).sort(-1).values
    span = groups[..., -1:] - groups[..., :1]
    gaps = groups.diff(dim=-1)
    # The grid step of a group: its smallest gap between distinct values (rounding of q * scale + offset aside).
    step = torch.where(gaps > span * 1e-4, gaps, torch.inf).amin(-1, keepdim=True)
    levels = ((groups - groups[..., :1]) / step).nan_to_num(0.0)
    bad = ((levels - levels.round()).abs().amax(-1) > 1e-2) | (levels.round().amax(-1) > 15)
    if bool(bad.any()):
        row, group = (int(i) for i in bad.nonzero()[0])
        return (
            f"{where}: values of row {row}, columns {group * g}..{group * g + g - 1} lie on no 16-level grid: "
            "the weights are not int4"
        )
    return None


def test_undeclared_precision_refused(backend, conformance, undeclared, tiny):
    try:
        harness.make_engine(backend, tiny, undeclared)
    except UserError as exc:
        conformance.expect(
            undeclared in str(exc), undeclared, "clear error", f"the refusal does not name the precision: {exc}"
        )
        return
    conformance.expect(
        False, undeclared, "refused", f"precision {undeclared} is not declared but the engine accepted it"
    )


@pytest.fixture(scope="session")
def invariant_precision(backend) -> str:
    """The precision the backend runs by default: invariants judge logits with that precision's tolerance."""
    return backend.default_precision


def _greedy(engine, prompts, max_tokens=12):
    return harness.outputs(
        harness.run_requests(engine, prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    )


def _tapes(engine) -> tuple[harness.LogitTape, harness.OpTape]:
    """Recorders of a run: the logits behind each token, and each op's output rows (to name where runs part)."""
    return harness.LogitTape(engine), harness.OpTape(engine)


def _taped(engine, prompts, params: SamplingParams | None = None):
    """Run `prompts` together, recording the logits behind each token and the ops: (sequences, tapes)."""
    tapes = _tapes(engine)
    return harness.run_requests(engine, prompts, params or SamplingParams(max_tokens=12, ignore_eos=True)), tapes


def _taped_alone(engine, prompts, params: SamplingParams | list[SamplingParams]):
    tapes = _tapes(engine)
    params = params if isinstance(params, list) else [params] * len(prompts)
    return [harness.run_requests(engine, [q], sp)[0] for q, sp in zip(prompts, params)], tapes


def check_same_run(conformance, precision: str, label: str, fast, plain, greedy: bool = True) -> bool:
    """Two runs that must agree up to the rounding of `precision`: logits step by step (step_logits), and no
    token change the logits do not explain. A failure names the first op call where the runs part."""
    (fast_seqs, (fast_logits, fast_ops)), (plain_seqs, (plain_logits, plain_ops)) = fast, plain
    limit = THRESHOLDS["step_logits"].limit(precision)
    d = harness.divergence(fast_logits, fast_seqs, plain_logits, plain_seqs, limit, greedy)
    detail = d.where
    if d.request is not None and (d.fault is not None or not d.worst <= limit):
        column = DTYPE_BOUND.get(getattr(fast_ops, "dtype", None), precision)

        def bound(op: str) -> float:
            return THRESHOLDS[op].limit(precision if op == "linear" else column)

        i = d.request
        blame = harness.first_op_divergence(fast_ops, fast_seqs[i], plain_ops, plain_seqs[i], d.step, bound)
        detail = "; ".join(filter(None, [detail, blame]))
    return conformance.check("step_logits", precision, d.worst, label, detail=detail, fault=d.fault)


FEATURE_SETTINGS = {
    "chunked_prefill": {"chunked_prefill": True, "max_num_batched_tokens": 16},
    "cuda_graphs": {"cuda_graphs": True},
    "spec_decode": {"spec": "ngram", "spec_tokens": 4},
}
FEATURE_WORD = {"chunked_prefill": "chunked_prefill", "cuda_graphs": "cuda_graphs", "spec_decode": "spec"}


def _feature_prompts(feature: str) -> list[list[int]]:
    if feature == "spec_decode":  # repeated motifs give the n-gram drafter something to propose
        return [(m * 6)[:n] for m, n in zip(harness.tiny_prompts(3, 7, lengths=(5, 3, 7)), (30, 21, 40))]
    return harness.tiny_prompts(5, 3)


@pytest.mark.parametrize("feature", FEATURES)
def test_feature(backend, conformance, invariant_precision, tiny, feature):
    """A declared optimization must not change greedy output beyond rounding; an undeclared one is refused."""
    p = invariant_precision
    settings = harness.plain_profile() | FEATURE_SETTINGS[feature]
    if not declares(backend, feature):
        try:
            harness.make_engine(backend, tiny, p, **settings)
        except UserError as exc:
            conformance.expect(
                FEATURE_WORD[feature] in str(exc), p, "refused clearly", f"the refusal does not name {feature}: {exc}"
            )
            return
        conformance.expect(False, p, "refused", f"{feature} is not declared but the engine accepted it")
        return
    prompts = _feature_prompts(feature)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    fast = harness.make_engine(backend, tiny, p, **settings)
    with_feature = _taped(fast, prompts, params)
    plain = _taped(harness.make_engine(backend, tiny, p, **harness.plain_profile()), prompts, params)
    check_same_run(conformance, p, f"{feature} == plain greedy", with_feature, plain)
    # The optimization must really have run, or the comparison proved nothing.
    used = {
        "chunked_prefill": lambda: fast.scheduler.prefill_chunks,
        "cuda_graphs": lambda: getattr(fast.runner, "graph_replays", 0),
        "spec_decode": lambda: fast.spec_stats()["drafted"],
    }[feature]()
    conformance.expect(used > 0, p, f"{feature} was used", f"{feature} is declared but the engine never used it")


def test_prefix_cache_hit_equals_miss(backend, conformance, invariant_precision, tiny):
    """Declared: a hit at a block boundary gives the miss's output. Declared off: no prefix is ever reused."""
    p = invariant_precision
    bs = block_size(backend)
    shared = harness.tiny_prompts(1, 11, lengths=(3 * bs,))[0]  # ends exactly on a block boundary
    prompts = [shared + [5, 9], shared + [77], shared + [5, 9], shared]
    cached = harness.make_engine(backend, tiny, p, **harness.plain_profile(), prefix_caching=True)
    tapes = _tapes(cached)
    seqs = [harness.run_requests(cached, [q], SamplingParams(max_tokens=12, ignore_eos=True))[0] for q in prompts]
    hits = [s.num_cached_prefix for s in seqs]
    if not declares(backend, "prefix_caching"):
        conformance.expect(
            sum(hits) == 0 and cached.blocks.prefix_hits == 0,
            p,
            "declared off is off",
            f"prefix_caching is declared off, yet cached prefix tokens were reused: {hits} per request",
        )
        return
    conformance.expect(all(h > 0 for h in hits[1:]), p, "prefix cache hit", f"cached prefix tokens per request: {hits}")
    uncached = harness.make_engine(backend, tiny, p, **harness.plain_profile(), prefix_caching=False)
    check_same_run(
        conformance,
        p,
        "hit == miss",
        (seqs, tapes),
        _taped_alone(uncached, prompts, SamplingParams(max_tokens=12, ignore_eos=True)),
    )


def test_batch_invariance(backend, conformance, invariant_precision, tiny):
    p = invariant_precision
    # No prefix cache: the batched run must compute its prompts together (127 rows), not find them cached.
    engine = harness.make_engine(backend, tiny, p, **harness.plain_profile(), prefix_caching=False)
    prompts = harness.tiny_prompts(6, 5)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = _taped_alone(engine, prompts, params)
    check_same_run(conformance, p, "batched == alone", _taped(engine, prompts, params), alone)


def test_seeded_determinism(backend, conformance, invariant_precision, tiny):
    p = invariant_precision
    engine = harness.make_engine(backend, tiny, p, **harness.plain_profile())
    prompts = harness.tiny_prompts(4, 9)

    def params(seed_base: int) -> list[SamplingParams]:
        return [
            SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=seed_base + i, ignore_eos=True)
            for i in range(len(prompts))
        ]

    def batched(seed_base: int):
        tapes = _tapes(engine)
        seqs = [engine.add_request(q, sp) for q, sp in zip(prompts, params(seed_base))]
        while engine.has_work():
            engine.step()
        return seqs, tapes

    first = batched(100)
    if not check_same_run(conformance, p, "same seed same tokens", first, batched(100), greedy=False):
        return  # a fault already named (non-finite logits say so); the seed cases below would only echo it
    check_same_run(
        conformance, p, "seeded batch == alone", first, _taped_alone(engine, prompts, params(100)), greedy=False
    )
    changed, _ = harness.mismatches(harness.outputs(first[0]), harness.outputs(batched(500)[0]))
    conformance.expect(changed > 0, p, "other seed other tokens", "changing every seed changed no token")


# ---------------------------------------------------------------------------------------------------------------
# end to end on the default model, vs the CPU backend (slow)


@pytest.fixture(scope="module")
def default_model():
    from flashnext.core.loader import load_model

    return load_model(None)


def _cpu_backend():
    from flashnext.core import registry

    return registry.select(registry.discover(), "cpu").backend


@pytest.mark.slow
def test_e2e_default_model(backend, conformance, default_model):
    if backend.name == "cpu":
        pytest.skip("the CPU backend is the reference the end-to-end cases compare with")
    p = backend.default_precision
    tok = default_model.tokenizer
    # No prefix cache: prompt_logits needs each whole prompt computed in one step, after greedy runs of its prefix.
    engines = {
        name: harness.make_engine(
            b,
            default_model,
            prec,
            **harness.plain_profile(),
            max_model_len=1024,
            max_num_batched_tokens=1024,
            kv_cache_max_gib=0.25,
            prefix_caching=False,
        )
        for name, b, prec in (("backend", backend, p), ("cpu", _cpu_backend(), "fp32"))
    }
    # Greedy, judged at the backend's own precision by teacher forcing: the CPU's 16 greedy tokens go through both
    # in one step; where the CPU's choice is clear (CLEAR_MARGIN), the backend must make it too. Exact token
    # streams would test rounding: bf16 leaves fp32's greedy path after 5 tokens on these prompts on the CPU itself.
    prompts = [tok.encode(t) for t in GREEDY_PROMPTS]
    clear = agree = 0
    first_off = ""
    for i, (q, out) in enumerate(zip(prompts, _greedy(engines["cpu"], prompts, 16))):
        rows = slice(len(q) - 1, len(q) + len(out) - 1)  # the positions that predict each output token
        mine, ref = (harness.prompt_logits(engines[n], q + out)[rows] for n in ("backend", "cpu"))
        top2 = ref.double().topk(2).values
        is_clear = (top2[:, 0] - top2[:, 1]) > CLEAR_MARGIN[p]
        picks = mine.argmax(-1) == torch.tensor(out)
        clear += int(is_clear.sum())
        agree += int((picks & is_clear).sum())
        off = (is_clear & ~picks).nonzero().flatten().tolist()
        if off and not first_off:
            j = off[0]
            first_off = (
                f"first clear step missed: prompt {i} step {j}, cpu token {out[j]} (margin "
                f"{float(top2[j, 0] - top2[j, 1]):.3g}), backend token {int(mine[j].argmax())}"
            )
    conformance.check(
        "e2e_greedy_agreement",
        p,
        agree / max(clear, 1),
        "greedy vs cpu",
        detail=f"{agree} of {clear} clear steps agree; {first_off}",
        fault=None
        if clear >= 8
        else f"only {clear} of 48 steps have a margin {p} rounding cannot bridge (CLEAR_MARGIN {CLEAR_MARGIN[p]:g}"
        " logits): nothing to judge",
    )
    ids = tok.encode(SHAKESPEARE)
    ppl = {n: _perplexity(harness.prompt_logits(engines[n], ids), ids) for n in ("backend", "cpu")}
    rel = abs(ppl["backend"] - ppl["cpu"]) / ppl["cpu"]
    conformance.check(
        "e2e_perplexity", p, rel, "shakespeare", detail=f"perplexity {ppl['backend']:.3f} vs cpu {ppl['cpu']:.3f}"
    )


def _perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    nll = F.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:]))
    return math.exp(float(nll))
