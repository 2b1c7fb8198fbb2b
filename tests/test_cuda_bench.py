"""`flashnext bench`: the JSON rows DESIGN.md names, on the CPU with a tiny random model; bad flags exit 2."""

import json

import pytest
import torch
from typer.testing import CliRunner

from flashnext.core.cli import app
from flashnext.core.cli_bench import SHAPES, bench_rows, load_bench_model, random_model
from flashnext.core.config import ModelConfig

KEYS = {
    "machine",
    "backend",
    "shape",
    "batch_size",
    "prompt_len",
    "gen_len",
    "ttft_s",
    "decode_tok_s",
    "throughput_tok_s",
    "peak_memory_bytes",
    "flashnext_version",
    "precision",
    "profile",
}


TINY = ModelConfig(
    architecture="llama",
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    max_position_embeddings=128,
    tie_word_embeddings=True,
)


def test_bench_rows_report_every_contract_key(monkeypatch):
    monkeypatch.setitem(SHAPES, "tiny-bench", TINY)
    loaded = random_model("tiny-bench", torch.device("cpu"))
    rows = bench_rows(loaded, "cpu", "fp32", None, [1, 3], prompt_len=5, gen_len=4)
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        assert r.keys() >= KEYS
        assert r["backend"] == "cpu" and r["shape"] == "tiny-bench"
        assert r["ttft_s"] > 0 and r["decode_tok_s"] > 0 and r["throughput_tok_s"] > 0
    json.dumps(rows)  # serializable as written by --json


def test_bench_rejects_bad_flags_with_exit_code_2(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "--shape", "gpt-7", "--backend", "cpu"])
    assert result.exit_code == 2 and "qwen3-0.6b" in result.output
    result = runner.invoke(app, ["bench", "--shape", "smollm2-135m", "--batch-sizes", "1,x"])
    assert result.exit_code == 2 and "--batch-sizes" in result.output


def test_bench_shapes_are_built_on_the_cpu_as_a_checkpoint_is_read(monkeypatch):
    """An accelerator then holds only what the engine keeps (not the bf16 originals of int4 or fp8 weights), so the
    peak memory `flashnext bench` reports is the engine's; the same seed gives the same weights."""
    monkeypatch.setitem(SHAPES, "tiny-bench", TINY)
    loaded = load_bench_model(None, "tiny-bench", seed=3)
    assert {w.device.type for w in loaded.weights.values()} == {"cpu"}
    again = load_bench_model(None, "tiny-bench", seed=3).weights
    assert all(torch.equal(w, again[name]) for name, w in loaded.weights.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_memory_counts_the_captures_after_a_prefill_left_the_cache_full():
    """The bench's captures follow prefills whose freed activations torch keeps cached; the capture memory the
    rows and the metric report is still the graphs' pool, not 0."""
    loaded = load_bench_model(None, "qwen3-0.6b", seed=0)
    rows = bench_rows(loaded, "cuda", "bf16", "full", [1, 8], prompt_len=256, gen_len=8)
    assert [r["graph_captures"] for r in rows] == [1, 2]
    assert 0 < rows[0]["graph_memory_bytes"] < rows[1]["graph_memory_bytes"] < 1 << 30
