"""The engine benchmarks run end to end on a tiny model and report what they claim."""

import json
import subprocess
import sys
from pathlib import Path

from fixtures import write_tiny_hf_model

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(BENCH / script), "--threads", "1", *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_bench_engine_reports_throughput_and_latency_percentiles(tmp_path):
    model = write_tiny_hf_model(tmp_path / "tiny", arch="qwen3")
    out = tmp_path / "engine.json"
    done = run("bench_engine.py", "--backend", "cpu", "--model", str(model), "--num-requests", "12",
               "--prompt-len", "5,120", "--output-len", "3,20", "--max-num-batched-tokens", "32", "--json", str(out))
    r = json.loads(out.read_text())
    assert "output tok/s" in done.stdout
    assert r["num_requests"] == 12 and r["backend"] == "cpu" and r["profile"]["max_num_batched_tokens"] == 32
    assert 12 * 3 <= r["output_tokens"] <= 12 * 20
    assert r["output_tok_s"] > 0 and r["prefill_chunks"] > 0
    for key in ("ttft_s", "itl_s", "e2e_s"):
        p = r[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"]
    assert r["ttft_s"]["p99"] <= r["e2e_s"]["p99"]


def test_bench_prefill_memory_shows_chunking_bounds_activations(tmp_path):
    # 1536 tokens: the unchunked step materializes 4 heads x 1536^2 fp32 attention scores (~36 MiB per layer).
    model = write_tiny_hf_model(tmp_path / "tiny", arch="llama", max_position_embeddings=2048)
    out = tmp_path / "memory.json"
    run("bench_prefill_memory.py", "--backend", "cpu", "--model", str(model), "--prompt-len", "1536",
        "--chunk", "64", "--json", str(out))
    r = json.loads(out.read_text())
    whole, chunked = r["runs"]
    assert (whole["mode"], chunked["mode"]) == ("unchunked", "chunked")
    assert whole["steps"] == 1 and chunked["steps"] == 24
    assert whole["activation_peak_bytes"] > 16 << 20
    assert r["ratio"] < 0.5
