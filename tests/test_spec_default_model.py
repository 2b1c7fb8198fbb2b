"""Speculative decoding on the path users get: the embedded model on the CPU backend at its default precision."""

import pytest

from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.llm import LLM

PROMPTS = [
    "Repeat this text exactly: The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",  # noqa: E501 (one prompt)
    "List the days of the week: Monday, Tuesday,",
    "Write a short poem about the sea.",
]


@pytest.mark.slow
def test_ngram_is_lossless_on_the_default_model_alone_and_batched():
    llms = {spec: LLM(backend="cpu", spec=spec, spec_tokens=4) for spec in ("none", "ngram")}
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = [llms["none"].generate([p], params, chat=True)[0].token_ids for p in PROMPTS]
    alone = [llms["ngram"].generate([p], params, chat=True)[0].token_ids for p in PROMPTS]
    batched = [c.token_ids for c in llms["ngram"].generate(PROMPTS, params, chat=True)]
    assert alone == plain and batched == plain
    stats = llms["ngram"].engine.spec_stats()
    assert stats["accepted"] > 0 and stats["drafted"] >= stats["accepted"]
    assert llms["ngram"].engine.blocks.num_free == llms["ngram"].engine.blocks.num_blocks
