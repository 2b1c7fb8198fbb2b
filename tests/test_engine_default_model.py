"""Chunked prefill and prefix-cache equivalence on the real default model (SmolLM2-135M, fp32 on the CPU)."""

import pytest

from flashnext.core.engine.engine import LLMEngine
from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.loader import load_model
from flashnext.plugins.cpu import CpuBackend
from test_engine import assert_same_logits, one_thread, prefill_logits  # noqa: F401 (one_thread: autouse here too)

pytestmark = pytest.mark.slow

TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the "
    "great lens, and watched the ships pass along the rocky coast. In winter the storms came from the north, and "
    "the waves broke over the harbour wall. The villagers said he had not missed a single night in forty years. "
    "One morning a young woman arrived with a letter from the harbour master, asking him to teach her the work. "
)


@pytest.fixture(scope="module")
def default_model():
    return load_model(None)


def engine_for(loaded, **overrides) -> LLMEngine:
    backend = CpuBackend()
    profile = backend.profiles()["full"].overridden(**({"kv_cache_max_gib": 0.25, "max_num_seqs": 4} | overrides))
    return LLMEngine(backend, loaded, "fp32", profile)


def test_chunked_and_cached_prefill_match_unchunked_on_the_default_model(default_model):
    prompt = default_model.tokenizer.encode(TEXT * 2)
    assert len(prompt) > 150 and len(prompt) % 64 and len(prompt) % 16
    engine = engine_for(default_model, prefix_caching=False)
    _, whole = prefill_logits(engine, prompt, len(prompt))
    for chunk in (16, 64):
        assert_same_logits(prefill_logits(engine, prompt, chunk)[1], whole)
    cached = engine_for(default_model)
    prefill_logits(cached, prompt[:100], 100)  # publishes 6 blocks of 16
    start, hit = prefill_logits(cached, prompt, 64)
    assert start == 96
    assert_same_logits(hit, whole[start:])


def test_greedy_text_is_the_same_unchunked_chunked_cached_and_batched(default_model):
    tok = default_model.tokenizer
    prompt = tok.encode(TEXT)
    others = [tok.encode(TEXT[:90]), tok.encode("Write a short poem about the sea.")]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = engine_for(default_model, chunked_prefill=False).generate([prompt], params)[0].output_ids
    chunked = engine_for(default_model, max_num_batched_tokens=32)
    got = chunked.generate([prompt], params)[0].output_ids
    assert got == want and chunked.scheduler.prefill_chunks > 1
    again = chunked.generate([prompt], params)[0]  # served from the prefix cache this time
    assert again.num_cached_prefix >= 64 and again.output_ids == want
    batched = engine_for(default_model, max_num_batched_tokens=48).generate(others + [prompt], params)
    assert batched[-1].output_ids == want
    assert len(set(want)) > 4  # real text, not one repeated token
