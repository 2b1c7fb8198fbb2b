"""Speculative decoding on tiny random models (CPU, fp32): lossless, distribution-preserving, leak-free.

Greedy and seeded outputs with `ngram` and `mtp` drafts must equal `--spec none` token for token, single and
batched, through chunked prefill, prefix hits and preemption; temperature-1 samples must follow the target's own
distribution (chi-square); rolled-back drafts must leave every block free at the end.
"""

import json
import math
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures import tiny_weights, write_tiny_hf_model
from flashnext.core.engine.engine import GIB, LLMEngine
from flashnext.core.engine.runner import ModelRunner
from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.errors import UserError
from flashnext.core.loader import load_model
from flashnext.core.spec import decoder
from flashnext.core.spec.adaptive import FIRST_PAUSE, AcceptanceTracker
from flashnext.core.spec.drafter import NGRAM_RULE
from flashnext.core.spec.ngram import lookup
from flashnext.plugins.cpu import CpuBackend

BS = 4


def write_tiny_mtp_model(dir, arch: str = "qwen3", seed: int = 0, **overrides):
    """A tiny checkpoint plus one random DeepSeek-V3 style MTP module at `model.layers.{num_layers}`."""
    path = write_tiny_hf_model(dir, arch=arch, seed=seed, num_nextn_predict_layers=1, **overrides)
    cfg = json.loads((path / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    weights = load_file(str(path / "model.safetensors"))
    block = tiny_weights(cfg | {"num_hidden_layers": 1, "tie_word_embeddings": True}, arch, seed + 1)
    prefix = f"model.layers.{n}."
    weights |= {k.replace("model.layers.0.", prefix): v for k, v in block.items() if k.startswith("model.layers.0.")}
    g = torch.Generator().manual_seed(seed + 2)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        weights[f"{prefix}{norm}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    weights[prefix + "eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(write_tiny_hf_model(tmp_path_factory.mktemp("spec-llama"), arch="llama"))


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    return load_model(write_tiny_mtp_model(tmp_path_factory.mktemp("spec-mtp")))


def kv_gib(loaded, num_blocks: int) -> float:
    cfg = loaded.config
    layers = cfg.num_layers + (1 if cfg.num_mtp_modules else 0)
    return (num_blocks + 0.5) * 2 * layers * BS * cfg.num_kv_heads * cfg.head_dim * 4 / GIB


def engine_for(loaded, spec="none", k=4, num_blocks=4096, **overrides) -> LLMEngine:
    backend = CpuBackend()
    settings = dict(
        block_size=BS,
        max_num_batched_tokens=64,
        kv_cache_max_gib=kv_gib(loaded, num_blocks),
        spec=spec,
        spec_tokens=k,
        max_num_seqs=32,
    )
    return LLMEngine(backend, loaded, "fp32", backend.profiles()["full"].overridden(**(settings | overrides)))


def copy_heavy_prompts(loaded, count=6, seed=0) -> list[list[int]]:
    """Random text repeated with edits: the kind of prompt n-gram drafts help with (and models tend to loop on)."""
    rng, vocab = random.Random(seed), loaded.config.vocab_size
    out = []
    for _ in range(count):
        text = [rng.randrange(3, vocab) for _ in range(rng.randrange(6, 30))]
        edited = [t if rng.random() > 0.1 else rng.randrange(3, vocab) for t in text]
        out.append(text + edited + text[: rng.randrange(2, len(text))])
    return out


def generate(engine: LLMEngine, prompts, params: SamplingParams) -> list[list[int]]:
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs]


def assert_no_leak(engine: LLMEngine):
    blocks = engine.blocks
    assert blocks.num_free == blocks.num_blocks and set(blocks.ref_counts) == {0}


GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_ngram_greedy_is_lossless_single_and_batched(tiny, k):
    prompts = copy_heavy_prompts(tiny)
    want = generate(engine_for(tiny), prompts, GREEDY)
    batched = engine_for(tiny, "ngram", k)
    assert generate(batched, prompts, GREEDY) == want
    single = engine_for(tiny, "ngram", k)
    assert [generate(single, [p], GREEDY)[0] for p in prompts] == want
    for engine in (batched, single):
        stats = engine.spec_stats()
        assert 0 < stats["accepted"] < stats["drafted"]  # both the accept and the rollback paths ran
        assert len(stats["accepted_per_position"]) <= k
        assert_no_leak(engine)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_mtp_greedy_is_lossless_single_and_batched(tiny_mtp, k):
    prompts = copy_heavy_prompts(tiny_mtp, seed=1)
    want = generate(engine_for(tiny_mtp), prompts, GREEDY)
    for engine, got in (
        (e := engine_for(tiny_mtp, "mtp", k), generate(e, prompts, GREEDY)),
        (f := engine_for(tiny_mtp, "mtp", k, spec_adaptive=False), [generate(f, [p], GREEDY)[0] for p in prompts]),
    ):
        assert got == want
        assert engine.spec_stats()["drafted"] > 0
        assert_no_leak(engine)


def test_lossless_through_chunking_prefix_hits_and_preemption(tiny):
    prompts = copy_heavy_prompts(tiny, count=8, seed=2)
    prompts += [p[:-3] + [5, 6, 7] for p in prompts[:3]]  # shared prefixes: prefix-cache hits
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    want = generate(engine_for(tiny), prompts, params)
    # 16-token budget chunks every prompt; 60 blocks cannot hold 11 growing sequences, so some are preempted.
    engine = engine_for(tiny, "ngram", 4, num_blocks=60, max_num_batched_tokens=16)
    assert generate(engine, prompts, params) == want
    assert engine.scheduler.preemptions > 0 and engine.scheduler.prefill_chunks > 0
    assert engine.blocks.prefix_hits > 0 and engine.spec_stats()["accepted"] > 0
    assert_no_leak(engine)


def test_seeded_sampling_is_identical_to_plain_sampling(tiny):
    """The target samples each verified row with noise keyed by (seed, position): same seed, same tokens."""
    prompts = copy_heavy_prompts(tiny, count=4, seed=3)
    for temperature, top_k, top_p in ((0.3, 0, 1.0), (0.5, 20, 0.9)):
        params = SamplingParams(
            max_tokens=40, ignore_eos=True, temperature=temperature, top_k=top_k, top_p=top_p, seed=11
        )
        want = generate(engine_for(tiny), prompts, params)
        engine = engine_for(tiny, "ngram", 3)
        assert generate(engine, prompts, params) == want
        assert engine.spec_stats()["drafted"] > 0


def test_stop_token_inside_accepted_drafts_ends_the_request(tiny):
    prompt = copy_heavy_prompts(tiny, count=1, seed=4)[0]
    free_run = generate(engine_for(tiny), [prompt], GREEDY)[0]
    stop = free_run[len(free_run) // 2]
    params = SamplingParams(max_tokens=40, stop_token_ids=[stop])
    want = generate(engine_for(tiny), [prompt], params)
    engine = engine_for(tiny, "ngram", 4)
    assert generate(engine, [prompt], params) == want and want[0][-1] == stop
    assert_no_leak(engine)


def test_max_tokens_is_never_exceeded(tiny):
    prompts = copy_heavy_prompts(tiny, count=4, seed=5)
    for max_tokens in (1, 2, 3, 7):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        got = generate(engine_for(tiny, "ngram", 4), prompts, params)
        assert got == generate(engine_for(tiny), prompts, params)
        assert all(len(out) == max_tokens for out in got)


def test_drafting_pauses_while_the_batch_is_larger_than_spec_max_batch(tiny):
    prompts = copy_heavy_prompts(tiny, count=3, seed=6)
    crowded = engine_for(tiny, "ngram", 4, spec_max_batch=2)
    assert generate(crowded, prompts, GREEDY) == generate(engine_for(tiny), prompts, GREEDY)
    assert crowded.spec_stats()["drafts"] == 0
    roomy = engine_for(tiny, "ngram", 4, spec_max_batch=3)
    generate(roomy, prompts, GREEDY)
    assert roomy.spec_stats()["drafts"] > 0


class SilentDeviceDrafter:
    """A DeviceDrafter that never drafts: the runner steps as plain decoding, with the look-ahead slots kept."""

    method, rule = "ngram", NGRAM_RULE

    def stats(self) -> decoder.SpecStats:
        return decoder.SpecStats()


def test_a_runner_that_drafts_itself_gets_no_drafts_but_kept_slots(tiny, monkeypatch):
    """A runner with a device drafter drafts and verifies by itself: the engine drafts nothing and keeps len +
    lookahead KV slots allocated for the runner to fill ahead (from free blocks only)."""
    monkeypatch.setattr(ModelRunner, "device_drafter", SilentDeviceDrafter())
    monkeypatch.setattr(ModelRunner, "lookahead_tokens", 24)
    engine = engine_for(tiny, "ngram", 4)
    prompts = copy_heavy_prompts(tiny, count=2, seed=3)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
        assert all(not s.draft_ids for s in seqs)
        for s in seqs:
            if s.finish_reason is None and s.num_uncomputed == 1:
                assert len(s.block_table) * BS >= len(s) + 24
    assert engine.spec_stats()["drafts"] == 0
    assert [s.output_ids for s in seqs] == generate(engine_for(tiny), prompts, params)


def test_per_request_opt_out(tiny):
    engine = engine_for(tiny, "ngram", 4)
    prompts = copy_heavy_prompts(tiny, count=3, seed=6)
    seqs = [engine.add_request(p, GREEDY, spec_enabled=False) for p in prompts]
    while engine.has_work():
        engine.step()
    assert engine.spec_stats()["drafts"] == 0
    assert [s.output_ids for s in seqs] == generate(engine_for(tiny), prompts, GREEDY)


def test_mtp_drafts_match_a_from_scratch_recomputation(tiny_mtp):
    """The module's paged KV, kept up by catch-up steps across chunks, batches and rollbacks, gives the same drafts
    as running the module over the whole sequence at once."""
    prompts = copy_heavy_prompts(tiny_mtp, count=3, seed=7)
    engine = engine_for(tiny_mtp, "mtp", 3, max_num_batched_tokens=16, spec_adaptive=False)
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    seen = []  # (tokens so far, drafts proposed at that point)
    while engine.has_work():
        engine.step()
        seen += [(list(s.token_ids), list(s.draft_ids)) for s in seqs if s.draft_ids]
    assert len(seen) > 20
    for tokens, drafts in seen[::5]:
        fresh = engine_for(tiny_mtp, "mtp", 3, spec_adaptive=False, max_num_batched_tokens=4096)
        seq = fresh.add_request(tokens[:-1], SamplingParams(max_tokens=len(drafts) + 2, ignore_eos=True))
        fresh.step()  # prefill samples tokens[-1] again (greedy), then drafts from scratch
        assert seq.token_ids == tokens and seq.draft_ids == drafts


def test_mtp_needs_mtp_weights(tiny):
    with pytest.raises(UserError, match="ngram"):
        engine_for(tiny, "mtp")


def test_ngram_lookup():
    assert lookup([1, 2, 3, 4, 9, 1, 2, 3], 2) == [4, 9]  # longest suffix (1 2 3) first
    assert lookup([5, 6, 7, 5, 6, 8, 5, 6], 1) == [8]  # the most recent occurrence wins
    assert lookup([5, 6, 7, 8, 9, 5, 6, 1, 5, 6], 4) == [7, 8, 9, 5]  # ... unless only an older one has k tokens
    assert lookup([1, 2, 3, 4], 3) == []  # no repeated n-gram, no draft
    assert lookup([7, 7, 7], 4) == [7]


def test_tracker_pauses_probes_and_adapts_k():
    t = AcceptanceTracker(k=4, k_max=4)
    t.record(4, 0)
    assert t.k == 3 and t.drafts_wanted() == 3  # one bad step lowers K, does not pause
    t.record(3, 0)
    assert [t.drafts_wanted() for _ in range(FIRST_PAUSE)] == [0] * FIRST_PAUSE  # paused
    assert t.drafts_wanted() == 2  # the probe
    t.record(2, 0)  # failed probe: a longer pause
    assert sum(t.drafts_wanted() == 0 for _ in range(3 * FIRST_PAUSE)) == 2 * FIRST_PAUSE
    t.record(1, 1)  # a good probe turns drafting back on and grows K again
    t.record(2, 2)
    assert t.pause_left == 0 and t.k == 3 and t.drafts_wanted() == 3
    for _ in range(5):
        t.record(t.k, t.k)
    assert t.k == 4  # never above the bound
    fixed = AcceptanceTracker(k=4, k_max=4, adaptive=False)
    for _ in range(10):
        fixed.record(4, 0)
    assert fixed.drafts_wanted() == 4


def test_adaptive_pauses_drafting_that_never_pays(tiny_mtp):
    """Random MTP weights almost never guess right: adaptive mode drafts on a small share of steps."""
    prompts = copy_heavy_prompts(tiny_mtp, count=2, seed=8)
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    fixed = engine_for(tiny_mtp, "mtp", 2, spec_adaptive=False)
    adaptive = engine_for(tiny_mtp, "mtp", 2)
    assert generate(fixed, prompts, params) == generate(adaptive, prompts, params)
    assert adaptive.spec_stats()["drafts"] < fixed.spec_stats()["drafts"] / 3


# --- distribution --------------------------------------------------------------------------------------------


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square(df), Wilson-Hilferty approximation (no scipy needed)."""
    c = 2.0 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def chi_square(counts: dict, expected_p: dict, n: int) -> tuple[float, int]:
    """Pearson statistic with cells of expected count < 5 pooled; returns (statistic, degrees of freedom)."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in expected_p.items():
        e, o = p * n, counts.get(cell, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
        else:
            stat, cells = stat + (o - e) ** 2 / e, cells + 1
    if pooled_exp > 0:
        stat, cells = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, cells + 1
    return stat, cells - 1


def next_token_probs(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    seq = engine.add_request(prompt, SamplingParams(max_tokens=1))
    logits, _ = engine.runner.run(engine.scheduler.schedule())
    engine.abort(seq)
    return torch.softmax(logits[-1].double(), -1)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    # Eight tokens and sharp logits: every (t1, t2) pair has a visible probability. The test feeds token ids and never
    # tokenizes, so the fixture's larger tokenizer is let through the load check that refuses it in real models.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("flashnext.core.loaded_model.check_tokenizer_fits", lambda *args: None)
        return load_model(write_tiny_hf_model(tmp_path_factory.mktemp("spec-v8"), arch="llama", vocab_size=8, seed=3))


@pytest.mark.slow
def test_speculative_sampling_keeps_the_target_distribution(small_vocab, monkeypatch):
    # Every bigram (3, x) appears with a continuation, so whatever t1 is, an n-gram draft for t2 exists.
    prompt = [t for x in range(8) for t in (3, x, (x * 5 + 1) % 8)] + [3]
    n = 3000
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=s) for s in range(n)]
    exact_engine = engine_for(small_vocab)
    p1 = next_token_probs(exact_engine, prompt)
    expected = {
        (a, b): float(p1[a] * next_token_probs(exact_engine, prompt + [a])[b]) for a in range(8) for b in range(8)
    }

    def sample_pairs() -> tuple[dict, dict]:
        engine = engine_for(small_vocab, "ngram", 2, max_num_seqs=512, max_num_batched_tokens=4096, spec_max_batch=512)
        seqs = [engine.add_request(prompt, p) for p in params]
        while engine.has_work():
            engine.step()
        counts: dict = {}
        for s in seqs:
            counts[tuple(s.output_ids[:2])] = counts.get(tuple(s.output_ids[:2]), 0) + 1
        return counts, engine.spec_stats()

    counts, stats = sample_pairs()
    assert stats["accepted"] > 100 and stats["drafted"] - stats["accepted"] > 100  # both outcomes are common
    stat, df = chi_square(counts, expected, n)
    assert df > 10 and stat < chi_square_critical(df)
    # The test has teeth: a verifier that accepts every draft skews the distribution far past the critical value.
    monkeypatch.setattr(decoder, "accepted_length", lambda drafts, sampled: len(drafts))
    biased, _ = sample_pairs()
    assert chi_square(biased, expected, n)[0] > 3 * chi_square_critical(df)
