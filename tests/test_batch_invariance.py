"""Batch-invariant numerics on the CPU: a greedy request's tokens do not depend on what shares its steps.

The kernel tests are fast; the engine tests run the embedded default model (SmolLM2-135M int4) and are slow.
"""

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from fixtures import write_tiny_hf_model
from flashnext.core.engine.engine import LLMEngine
from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.kernels import AttentionMetadata
from flashnext.core.loader import load_model
from flashnext.core.precision import int4_quantize
from flashnext.plugins.cpu import CpuBackend
from flashnext.plugins.cpu.kernels import CpuKernels

ROW_COUNTS = (1, 2, 7, 8, 9, 16, 33, 64, 200)


def rows_alone_and_together(kernels, w, x):
    """Each row of x alone, and every prefix of x as one call: the rows as the bigger calls computed them."""
    alone = torch.cat([kernels.linear(x[i : i + 1], w) for i in range(max(ROW_COUNTS))])
    return alone, {m: kernels.linear(x[:m], w) for m in ROW_COUNTS}


@pytest.mark.parametrize("kind", ["int4", "fp32"])
def test_linear_rows_do_not_depend_on_the_row_count(kind):
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(96, 256, generator=gen) * 0.05
    w = int4_quantize(dense, group_size=32) if kind == "int4" else dense
    x = torch.randn(max(ROW_COUNTS), 256, generator=gen) * 3
    alone, together = rows_alone_and_together(CpuKernels(batch_invariant=True), w, x)
    for m, out in together.items():
        assert torch.equal(out, alone[:m]), f"{m} rows"


def test_without_the_option_int4_rows_change_with_the_row_count():
    """Why the option exists: a batch of 8 or more rows widens the weight to fp32, fewer run fp16 (so this test
    would fail if the default path ever became invariant by itself: then the option should go)."""
    gen = torch.Generator().manual_seed(0)
    w = int4_quantize(torch.randn(96, 256, generator=gen) * 0.05, group_size=32)
    x = torch.randn(max(ROW_COUNTS), 256, generator=gen) * 3
    alone, together = rows_alone_and_together(CpuKernels(), w, x)
    assert not torch.equal(together[64], alone[:64])


def paged(k, v, block_size=4):
    """A contiguous context [C, KV, D] laid into a paged cache, blocks in a shuffled order, and its block table."""
    n_blocks = -(-k.shape[0] // block_size)
    order = torch.randperm(n_blocks + 3, generator=torch.Generator().manual_seed(1))[:n_blocks]
    k_cache = torch.zeros(n_blocks + 3, block_size, *k.shape[1:])
    v_cache = torch.zeros_like(k_cache)
    for i, block in enumerate(order.tolist()):
        k_cache[block, : len(k[i * block_size : (i + 1) * block_size])] = k[i * block_size : (i + 1) * block_size]
        v_cache[block, : len(v[i * block_size : (i + 1) * block_size])] = v[i * block_size : (i + 1) * block_size]
    return k_cache, v_cache, order.tolist()


def test_prompt_positions_attend_as_their_decode_steps_whatever_the_chunking():
    gen = torch.Generator().manual_seed(2)
    ctx, heads, kv_heads, dim = 45, 6, 2, 16
    q = torch.randn(ctx, heads, dim, generator=gen)
    k, v = torch.randn(ctx, kv_heads, dim, generator=gen), torch.randn(ctx, kv_heads, dim, generator=gen)
    k_cache, v_cache, table = paged(k, v)
    kernels = CpuKernels(batch_invariant=True)

    def attend(start, end):  # queries start..end-1 as one chunk, over the context up to end
        meta = AttentionMetadata.from_host(list(range(start, end)), [end - start], [end], [table], "cpu")
        return kernels.attention(q[start:end], k_cache, v_cache, meta, dim**-0.5)

    decoded = torch.cat([attend(p, p + 1) for p in range(ctx)])
    for chunks in ([45], [13, 32], [1, 5, 16, 23], [40, 5]):
        bounds = [sum(chunks[:i]) for i in range(len(chunks) + 1)]
        chunked = torch.cat([attend(a, b) for a, b in zip(bounds, bounds[1:])])
        assert torch.equal(chunked, decoded), chunks


def test_cost_benchmark_reports_both_modes_per_round(tmp_path):
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_batch_invariance.py"
    spec = importlib.util.spec_from_file_location("bench_batch_invariance", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model, out = write_tiny_hf_model(tmp_path / "tiny", arch="llama"), tmp_path / "cost.json"
    args = ["--model", str(model), "--batch-sizes", "1,3", "--prompt-len", "24", "--gen-len", "4", "--rounds", "2"]
    bench.main([*args, "--kv-cache-max-gib", "0.01", "--json", str(out)])
    result = json.loads(out.read_text())
    keys = {"decode_tok_s_b1", "decode_tok_s_b3", "prefill_tok_s"}
    assert set(result["cost"]) == keys and result["batch_sizes"] == [1, 3]
    for mode in ("off", "on"):
        assert len(result["rounds"][mode]) == 2 and all(r["load_avg_1m"] >= 0 for r in result["rounds"][mode])
        assert all(result["median"][mode][k] > 0 for k in keys)


# --- the engine on the default model ------------------------------------------------------------------------------

WORDS = [
    "the",
    "a",
    "sea",
    "ship",
    "light",
    "keeper",
    "storm",
    "north",
    "harbour",
    "village",
    "letter",
    "morning",
    "night",
    "winter",
    "wave",
    "lens",
    "stairs",
    "poem",
    "river",
    "mountain",
    "road",
    "city",
    "bread",
    "garden",
    "window",
    "music",
]
MAX_TOKENS = 8
BUDGET = 64  # tokens a step: prompts longer than this are chunked, and chunks share steps with other prompts


@pytest.fixture(scope="module")
def default_model():
    return load_model(None)


@pytest.fixture(scope="module")
def prompts(default_model):
    """64 prompts of 1 to ~160 tokens (a sixth of them longer than a step's budget)."""
    rng = random.Random(7)
    lengths = [rng.choice((1, 3, 8, 20, 45, 150)) for _ in range(64)]
    return [default_model.tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(n))) for n in lengths]


def invariant_engine(loaded, **overrides) -> LLMEngine:
    backend = CpuBackend()
    settings = {"kv_cache_max_gib": 0.25, "max_num_seqs": 64, "max_num_batched_tokens": BUDGET, "batch_invariant": True}
    return LLMEngine(backend, loaded, None, backend.profiles()["full"].overridden(**(settings | overrides)))


def recording_logits(engine: LLMEngine) -> dict[int, list[torch.Tensor]]:
    """Every logits row the engine's runner computes, by sequence (its arrival index: an id() is reused once a
    finished sequence is freed) in step order: tokens can agree while the numbers under them differ, and the numbers
    must not."""
    rows: dict[int, list[torch.Tensor]] = {}
    step = engine.runner.step

    def recorded(inputs):
        result = step(inputs)
        at = 0
        for item in inputs.batch:
            rows.setdefault(item.seq.arrival_index, []).extend(result.logits[at : at + item.num_logits])
            at += item.num_logits
        return result

    engine.runner.step = recorded
    return rows


@pytest.fixture(scope="module")
def probes(default_model, prompts):
    """Three prompts (short, medium, chunked), each generated alone in a fresh engine: (prompt, tokens, logits)."""
    chosen = [min(prompts, key=len), sorted(prompts, key=len)[len(prompts) // 2], max(prompts, key=len)]
    assert len(chosen[2]) > 2 * BUDGET
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    out = []
    for prompt in chosen:
        engine = invariant_engine(default_model)
        logits = recording_logits(engine)
        seq = engine.generate([prompt], params)[0]
        out.append((prompt, seq.output_ids, logits[seq.arrival_index]))
    return out


def assert_same(logits: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(logits) == len(want) == MAX_TOKENS
    for i, (got, expected) in enumerate(zip(logits, want)):
        assert torch.equal(got, expected), (
            f"{what}: logits of token {i} differ by {float((got - expected).abs().max())}"
        )


@pytest.mark.slow
def test_default_model_is_int4_and_the_option_is_on(default_model):
    engine = invariant_engine(default_model)
    assert engine.precision.name == "int4" and engine.model.kernels.batch_invariant


@pytest.mark.slow
@pytest.mark.parametrize("size", [1, 2, 5, 16, 64])
def test_greedy_tokens_alone_equal_those_inside_a_batch(default_model, prompts, probes, size):
    rng = random.Random(size)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt, alone, alone_logits = probes[(size // 2) % 3]  # sizes 5, 16 and 64 hold the chunked one
    batch = [p for p in prompts if p is not prompt]
    rng.shuffle(batch)
    batch = batch[: size - 1]
    at = rng.randrange(size)
    batch.insert(at, prompt)
    engine = invariant_engine(default_model)
    logits = recording_logits(engine)
    outputs = engine.generate(batch, params)
    what = f"batch of {size}, prompt of {len(prompt)} tokens at {at}"
    assert outputs[at].output_ids == alone, what
    assert_same(logits[outputs[at].arrival_index], alone_logits, what)


@pytest.mark.slow
def test_greedy_tokens_equal_when_requests_arrive_mid_decode(default_model, prompts, probes):
    """Requests join a running batch at different points of the others' decodes and prefills (the scheduler mixes
    prompt chunks with decode rows in the same step); the prefix cache serves a repeated probe."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = invariant_engine(default_model)
    logits = recording_logits(engine)
    others = [engine.add_request(p, SamplingParams(max_tokens=3 * MAX_TOKENS, ignore_eos=True)) for p in prompts[:6]]
    seqs = []
    for prompt, _, _ in probes + probes:
        for _ in range(2):
            engine.step()
        seqs.append(engine.add_request(prompt, params))
        engine.add_request(prompts[len(seqs) + 10], params)
    while engine.has_work():
        engine.step()
    assert all(s.finish_reason == "length" for s in others)
    assert seqs[-1].num_cached_prefix > 0  # the second round of probes hit the prefix cache
    assert [s.output_ids for s in seqs] == [alone for _, alone, _ in probes + probes]
    for seq, (_, _, alone_logits) in zip(seqs, probes + probes):
        assert_same(logits[seq.arrival_index], alone_logits, f"prompt of {len(seq.prompt_ids)} tokens")
