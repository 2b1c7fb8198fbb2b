"""MTP checkpoint layouts beyond DeepSeek-V3's: Xiaomi MiMo's module (Qwen2 block at `model.mtp_layers.0`, hidden
state before embedding) from a tiny checkpoint in that naming, its drafts checked against a plain-torch
recomputation; a layout not read here is refused by name (CPU backend, fp32)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures import tiny_weights, write_tiny_hf_model
from flashnext.core.engine.runner import StepInput
from flashnext.core.engine.scheduler import ScheduledSeq
from flashnext.core.engine.sequence import SamplingParams, Sequence
from flashnext.core.errors import UserError
from flashnext.core.loader import load_model
from test_spec import copy_heavy_prompts, engine_for, generate

MIMO = "model.mtp_layers.0."


def write_tiny_mimo_model(dir, seed: int = 0):
    """A tiny MiMo-7B style checkpoint: a Qwen2 decoder plus one MTP module named as MiMo names it."""
    path = write_tiny_hf_model(
        dir, arch="qwen2", seed=seed, architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=1
    )
    cfg = json.loads((path / "config.json").read_text())
    h = cfg["hidden_size"]
    weights = load_file(str(path / "model.safetensors"))
    block = tiny_weights(cfg | {"num_hidden_layers": 1, "tie_word_embeddings": True}, "qwen2", seed + 1)
    weights |= {k.replace("model.layers.0.", MIMO): v for k, v in block.items() if k.startswith("model.layers.0.")}
    g = torch.Generator().manual_seed(seed + 2)
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        weights[f"{MIMO}{norm}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    weights[MIMO + "input_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def tiny_mimo(tmp_path_factory):
    return load_model(write_tiny_mimo_model(tmp_path_factory.mktemp("mimo")))


# --- a from-scratch MiMo MTP module, in plain torch over unpaged tensors ---------------------------------------


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, positions, theta):
    d = x.shape[-1]
    angles = positions[:, None].double() / theta ** (torch.arange(0, d, 2).double() / d)
    cos, sin = (f(angles).repeat(1, 2)[:, None].float() for f in (torch.cos, torch.sin))
    return x * cos + torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1) * sin


def qwen2_block(x, w, cfg):
    """One Qwen2 decoder layer over positions 0 .. len(x) - 1, causal."""
    eps, heads, kv_heads, hd = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    t, positions = x.shape[0], torch.arange(x.shape[0])

    def proj(name, inp):
        return inp @ w[f"self_attn.{name}_proj.weight"].T + w[f"self_attn.{name}_proj.bias"]

    h = rms(x, w["input_layernorm.weight"], eps)
    q = rope(proj("q", h).view(t, heads, hd), positions, cfg.rope_theta)
    k = rope(proj("k", h).view(t, kv_heads, hd), positions, cfg.rope_theta)
    v = proj("v", h).view(t, kv_heads, hd)
    k, v = (z.repeat_interleave(heads // kv_heads, dim=1) for z in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, heads * hd)
    x = x + attn @ w["self_attn.o_proj.weight"].T
    h = rms(x, w["post_attention_layernorm.weight"], eps)
    act = torch.nn.functional.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)
    return x + act @ w["mlp.down_proj.weight"].T


def mimo_drafts(loaded, hidden, tokens, k):
    """Drafts after `tokens` from the target's final hidden states at positions 0 .. len(tokens) - 2: the module over
    every position p (hidden p, token p + 1), then chained on its own normed output, as MiMo defines it."""
    cfg, eps = loaded.config, loaded.config.rms_norm_eps
    w = {name[len(MIMO) :]: t.float() for name, t in loaded.weights.items() if name.startswith(MIMO)}
    embed = loaded.weights["model.embed_tokens.weight"].float()
    head = loaded.weights.get("lm_head.weight", embed).float()
    states, ids, drafts = hidden, list(tokens[1:]), []
    for _ in range(k):
        x = torch.cat(
            (rms(states, w["hidden_layernorm.weight"], eps), rms(embed[ids], w["token_layernorm.weight"], eps)), -1
        )
        out = rms(qwen2_block(x @ w["input_proj.weight"].T, w, cfg), w["final_layernorm.weight"], eps)
        drafts.append(int((out[-1] @ head.T).argmax()))
        states, ids = torch.cat((hidden, out[-len(drafts) :])), list(tokens[1:]) + drafts
    return drafts


def target_hidden(loaded, tokens):
    """The target's final hidden states over `tokens` (a fresh engine's runner, one prefill)."""
    engine = engine_for(loaded)
    seq = Sequence(list(tokens), SamplingParams(max_tokens=1))
    seq.block_table = list(range(-(-len(tokens) // engine.blocks.block_size)))
    return engine.runner.step(StepInput([ScheduledSeq(seq, len(tokens), 1)], want_hidden=True)).hidden


def test_mimo_mtp_drafts_match_a_from_scratch_recomputation(tiny_mimo):
    """The MiMo module loads from its own names, drafts what a plain-torch MiMo MTP computes over the whole
    sequence (hidden-then-embedding, the normed output chained), and speculation with it stays lossless."""
    prompts = copy_heavy_prompts(tiny_mimo, count=2, seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine = engine_for(tiny_mimo, "mtp", 3, spec_adaptive=False)
    seqs = [engine.add_request(p, params) for p in prompts]
    seen = []
    while engine.has_work():
        engine.step()
        seen += [(list(s.token_ids), list(s.draft_ids)) for s in seqs if len(s.draft_ids) == 3]
    assert [s.output_ids for s in seqs] == generate(engine_for(tiny_mimo), prompts, params)
    assert len(seen) > 10
    for tokens, drafts in seen[::4]:
        hidden = target_hidden(tiny_mimo, tokens[:-1])
        assert mimo_drafts(tiny_mimo, hidden.float(), tokens, 3) == drafts


def test_an_mtp_layout_not_read_here_is_refused_by_name(tmp_path):
    """A checkpoint whose MTP weights follow another naming is refused with one line naming a weight, the layouts
    read, and --spec ngram."""
    path = write_tiny_hf_model(tmp_path, arch="qwen3", num_nextn_predict_layers=1)
    weights = load_file(str(path / "model.safetensors"))
    h = json.loads((path / "config.json").read_text())["hidden_size"]
    weights["mtp.fc.weight"] = torch.zeros(h, 2 * h)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError) as err:
        engine_for(load_model(path), "mtp")
    message = str(err.value)
    assert "\n" not in message and "'mtp.fc.weight'" in message and "--spec ngram" in message
    assert "DeepSeek-V3" in message and "MiMo" in message
