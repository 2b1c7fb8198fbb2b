"""Numerics against an outside reference: transformers' own model classes on the same weights, fp32.

Every position's logit vector must match (‖ours − ref‖ / ‖ref‖ ≤ 1e-4) and greedy continuations of 32 tokens must be
identical. Ours runs through the engine (scheduler → ModelRunner → DecoderModel on the cpu backend), not the model
alone, so paging, chunking and batching are covered too.
"""

import pytest
import torch
import transformers
from safetensors.torch import save_file

from fixtures import write_tiny_hf_model
from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.llm import LLM
from flashnext.core.loader import load_model
from numerics import SMOLLM_PROMPTS, engine_logits, relative_errors

REL_TOL = 1e-4
GEN_TOKENS = 32


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
        )
    return out[0, len(ids) :].tolist()


def hf_no_eos(model):
    """Greedy for exactly n steps on both sides: EOS neither stops nor is suppressed."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def check_against_hf(llm: LLM, hf_model, prompts: list[list[int]]) -> None:
    for ids in prompts:
        errors = relative_errors(engine_logits(llm, ids), hf_logits(hf_model, ids))
        assert errors.numel() == len(ids)
        worst = int(errors.argmax())
        assert errors.max() <= REL_TOL, f"position {worst} of {len(ids)}: relative logit error {errors.max():.2e}"
    # All prompts in one generate call: continuous batching must not change any greedy continuation.
    params = SamplingParams(max_tokens=GEN_TOKENS, ignore_eos=True)
    ours = [c.token_ids for c in llm.generate(prompts, params)]
    for ids, got in zip(prompts, ours):
        assert got == hf_greedy(hf_model, ids, GEN_TOKENS)


# ---------------------------------------------------------------------------------------------------------------
# The embedded default: SmolLM2-135M-Instruct Q4_1, dequantized, against LlamaForCausalLM


def hf_llama_from_loaded(loaded, folder):
    """A transformers LlamaForCausalLM holding exactly our dequantized weights (canonical names are HF's)."""
    c = loaded.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_ids[0],
    )
    state = {
        k: (w if isinstance(w, torch.Tensor) else w.dequantize(torch.float32)).float().contiguous()
        for k, w in loaded.weights.items()
    }
    hf_config.save_pretrained(folder)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return hf_no_eos(model.eval())


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    loaded = load_model(None)
    hf_model = hf_llama_from_loaded(loaded, tmp_path_factory.mktemp("smollm2-dequantized"))
    llm = LLM(loaded, backend="cpu", precision="fp32", max_num_seqs=4, max_model_len=1024)
    return llm, hf_model


@pytest.mark.slow
def test_smollm2_matches_transformers_llama(smollm):
    llm, hf_model = smollm
    prompts = [llm.encode(text, chat) for text, chat in SMOLLM_PROMPTS]
    assert len(prompts[-1]) >= 190 and prompts[1][0] == llm.tokenizer.token_to_id("<|im_start|>")
    check_against_hf(llm, hf_model, prompts)


@pytest.mark.slow
def test_smollm2_reference_is_the_same_weights(smollm):
    """Guard against comparing two copies of something else: the HF model holds our dequantized GGUF values."""
    llm, hf_model = smollm
    down = llm.engine.model.layers[7].down  # as the engine runs it: fp32, expanded from the GGUF's Q4_1 blocks
    ours = down if isinstance(down, torch.Tensor) else down.dequantize(torch.float32)
    assert torch.equal(hf_model.model.layers[7].mlp.down_proj.weight.detach(), ours)
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()  # tied, like ours


# ---------------------------------------------------------------------------------------------------------------
# Tiny random models of each family against transformers' own classes

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

TINY_CASES = {
    "llama-untied": dict(arch="llama", tie=False),
    "llama-tied": dict(arch="llama", tie=True),
    # original_max_position_embeddings 64 with head_dim 16 puts frequencies in all three llama3 bands.
    "llama-rope-llama3": dict(arch="llama", rope_scaling=LLAMA3_ROPE),
    "qwen2-qkv-bias": dict(arch="qwen2", tie=False),
    "qwen3-qk-norm": dict(arch="qwen3", tie=False),
    "qwen3-qk-norm-tied": dict(arch="qwen3", tie=True),
}

TINY_TEXT = "To be, or not to be, that is the question. The quick brown fox jumps over the lazy dog. "


@pytest.mark.parametrize("case", TINY_CASES)
def test_tiny_model_matches_transformers(tmp_path, case):
    spec = dict(TINY_CASES[case])
    folder = write_tiny_hf_model(tmp_path / case, seed=len(case), **spec)
    loaded = load_model(str(folder))
    hf_model = hf_no_eos(
        transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    )
    assert (
        type(hf_model).__name__
        == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[spec["arch"]]
    )
    if "rope_scaling" in spec:
        assert loaded.config.rope_scaling.type == "llama3"
        assert hf_model.config.rope_parameters["rope_type"] == "llama3"
    llm = LLM(loaded, backend="cpu", precision="fp32", max_num_seqs=4, max_model_len=512)
    prompts = [
        llm.encode("The quick brown fox"),
        llm.encode("hello there", chat=True),
        llm.encode(TINY_TEXT * 5)[:220],
    ]
    check_against_hf(llm, hf_model, prompts)
