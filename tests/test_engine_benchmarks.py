"""The engine benchmarks run end to end on a tiny model and report what they claim."""

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from fixtures import write_tiny_hf_model

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(BENCH / script), "--threads", "1", *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_bench_engine_reports_throughput_and_latency_percentiles(tmp_path):
    model = write_tiny_hf_model(tmp_path / "tiny", arch="qwen3")
    out = tmp_path / "engine.json"
    done = run(
        "bench_engine.py",
        "--backend",
        "cpu",
        "--model",
        str(model),
        "--num-requests",
        "12",
        "--prompt-len",
        "5,120",
        "--output-len",
        "3,20",
        "--max-num-batched-tokens",
        "32",
        "--json",
        str(out),
    )
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
    run(
        "bench_prefill_memory.py",
        "--backend",
        "cpu",
        "--model",
        str(model),
        "--prompt-len",
        "1536",
        "--chunk",
        "64",
        "--json",
        str(out),
    )
    r = json.loads(out.read_text())
    whole, chunked = r["runs"]
    assert (whole["mode"], chunked["mode"]) == ("unchunked", "chunked")
    assert whole["steps"] == 1 and chunked["steps"] == 24
    assert whole["activation_peak_bytes"] > 16 << 20
    assert r["ratio"] < 0.5


def test_bench_cuda_reports_the_fp8_ratio_as_the_median_of_interleaved_rounds(monkeypatch):
    """bench_cuda.py (importable without a GPU) runs the batch-64 rows behind the fp8 target round by round,
    interleaved, and reports the median of the rounds' fp8 / bf16 ratios and their spread next to the single-run
    ratios."""
    spec = importlib.util.spec_from_file_location("bench_cuda", BENCH / "bench_cuda.py")
    bench_cuda = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_cuda)
    rates = iter([100, 126, 140, 100, 131, 150, 110, 143, 160])  # bf16, fp8 + e5m2, + fp8 head; three rounds
    calls = []

    def fake_rows(loaded, backend, precision, profile, sizes, prompt, gen, **extra):
        calls.append((precision, sizes, extra))
        return [{"decode_tok_s": float(next(rates))}]

    monkeypatch.setattr(bench_cuda, "bench_rows", fake_rows)
    monkeypatch.setattr(bench_cuda, "release", lambda: None)
    bench_cuda.fp8_ratio_rounds(None)
    res = bench_cuda.results
    assert [c[0] for c in calls] == ["bf16", "fp8-e4m3", "fp8-e4m3"] * 3 and all(c[1] == [64] for c in calls)
    assert calls[2][2] == {"kv_cache_dtype": "fp8-e5m2", "quantize_lm_head": True}
    res["engine_rows"] = []
    lines = bench_cuda.summary(res)
    assert abs(res["ratios"]["fp8+fp8kv/bf16 decode b=64, median of 3"] - 1.3) < 1e-9  # of 1.26, 1.31, 1.30
    assert any("1.260 .. 1.310" in line for line in lines)


def test_bench_fp8_activation_scales_groups_as_the_cuda_decode_path():
    """The quality benchmark's round trip scales each group of columns on its own (a partial last group too),
    and its CUDA grouping is the kernels': the o input per power-of-two kv group else per head, the down input
    per SiLU program."""
    spec = importlib.util.spec_from_file_location("bench_fp8_scales", BENCH / "bench_fp8_activation_scales.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    x = torch.tensor([[1000.0, 1.0, 0.001, 0.002, 3.0]])
    per_token, grouped = bench.fp8_round_trip(x, 5), bench.fp8_round_trip(x, 2)
    assert per_token[0, 2] == 0  # 0.001 underflows next to 1,000 in one scale...
    assert torch.allclose(grouped, x, rtol=0.07)  # ...not in its own group; 3.0 alone in a partial group
    layers = [types.SimpleNamespace(o=object(), down=torch.empty(576, 1536)) for _ in range(2)]

    def model(heads, kv_heads, dim):
        cfg = types.SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim)
        return types.SimpleNamespace(config=cfg, layers=layers)

    smollm2, qwen3 = bench.cuda_groups(model(9, 3, 64)), bench.cuda_groups(model(16, 8, 128))
    assert smollm2[id(layers[0].o)] == 64 and qwen3[id(layers[1].o)] == 256
    assert smollm2[id(layers[0].down)] == 1024
    o_only = bench.cuda_groups(model(9, 3, 64), down=False)
    assert id(layers[0].down) not in o_only and o_only[id(layers[0].o)] == 64


def test_bench_int8_activations_rounds_each_block_as_the_kernels_do():
    """The int8 quality benchmark's round trip: a block's values at multiples of its largest magnitude / 127, an
    outlier coarsening its own block only (a partial last block too), as CudaKernels.int8_quantize_rows rounds."""
    spec = importlib.util.spec_from_file_location("bench_int8", BENCH / "bench_int8_activations.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    x = torch.tensor([[127.0, 0.4, 0.6, -1.5, 0.02, 0.01, 3.0]])
    whole, blocks = bench.int8_round_trip(x, 7), bench.int8_round_trip(x, 2)
    assert whole.tolist() == [[127.0, 0.0, 1.0, -1.0, 0.0, 0.0, 3.0]]  # floor(x + 0.5): -1.5 -> -1
    assert blocks[0, 4] == pytest.approx(0.02, rel=1e-6) and blocks[0, 6] == 3.0  # each its block's largest
    assert blocks[0, 5] == pytest.approx(64 * 0.02 / 127, rel=1e-6)  # 0.01 * 127 / 0.02 = 63.5 rounds up to 64
    assert torch.allclose(blocks[0, 2:4], x[0, 2:4], rtol=0.01)


def test_bench_fp8_block_rounding_stores_blocks_as_checkpoints_do():
    """The block-rounding benchmark's checkpoint: each block's largest magnitude lands on e4m3's 448 (partial
    blocks at the edges, an all-zero block keeps multiplier 1), and its error measure is relative."""
    spec = importlib.util.spec_from_file_location("bench_block", BENCH / "bench_fp8_block_rounding.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    w = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    w[3:, 4:] = 0
    stored = bench.block_fp8(w, block=(3, 4))
    assert stored.block == (3, 4) and stored.scale.shape == (2, 2) and stored.scale[1, 1] == 1
    assert torch.equal(stored.data.float().abs().amax(), torch.tensor(448.0))
    assert torch.allclose(stored.dequantize(), w, rtol=1 / 16, atol=1e-6)
    assert bench.nmse(2 * w, w) == pytest.approx(1.0)


def test_bench_shapes_reports_each_precision_over_the_first(tmp_path):
    out = tmp_path / "shapes.json"
    done = run(
        "bench_shapes.py",
        "--backend",
        "cpu",
        "--shapes",
        "smollm2-135m",
        "--precisions",
        "bf16,int4",
        "--batch-sizes",
        "1,2",
        "--prompt-len",
        "8",
        "--gen-len",
        "3",
        "--json",
        str(out),
    )
    r = json.loads(out.read_text())
    assert "decode, 8 in / 3 out" in done.stdout and r["bench"] == "decode_by_shape"
    bf16_1, bf16_2, int4_1, int4_2 = r["rows"]
    runs = [(x["precision"], x["batch_size"]) for x in r["rows"]]
    assert runs == [("bf16", 1), ("bf16", 2), ("int4", 1), ("int4", 2)]
    assert bf16_1["decode_over_bf16"] == bf16_2["decode_over_bf16"] == 1.0
    assert int4_1["params"] == bf16_1["params"] > 1e8 and bf16_1["layers"] == 30
    for int4, bf16 in ((int4_1, bf16_1), (int4_2, bf16_2)):
        assert abs(int4["decode_over_bf16"] - int4["decode_tok_s"] / bf16["decode_tok_s"]) < 1e-3
    bad = subprocess.run(
        [sys.executable, str(BENCH / "bench_shapes.py"), "--shapes", "qwen3-9b"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "'qwen3-9b': choose from" in bad.stderr and "Traceback" not in bad.stderr
    for flag, value in (("--precisions", "int3"), ("--batch-sizes", "1,x"), ("--backend", "rocm")):
        bad = subprocess.run(
            [sys.executable, str(BENCH / "bench_shapes.py"), "--shapes", "smollm2-135m", flag, value],
            capture_output=True,
            text=True,
        )
        last = bad.stderr.strip().splitlines()[-1]
        assert bad.returncode == 2 and "Traceback" not in bad.stderr and "error:" in last and value in last, flag


def test_random_weights_of_an_untied_config_carry_their_own_head():
    from flashnext.core.cli_bench import SHAPES, random_model_of
    from flashnext.core.engine.sequence import SamplingParams
    from flashnext.core.llm import LLM

    cfg = SHAPES["smollm2-135m"].model_copy(update=dict(num_layers=2, vocab_size=512, tie_word_embeddings=False))
    loaded = random_model_of(cfg, "untied", torch.device("cpu"))
    head, table = loaded.weights["lm_head.weight"], loaded.weights["model.embed_tokens.weight"]
    assert head.shape == table.shape == (512, 576) and not torch.equal(head, table)
    llm = LLM(model=loaded, backend="cpu", max_model_len=64)
    out = llm.engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].output_ids) == 4


def test_ptx_census_shows_the_int4_gemv_reading_four_words_a_load(tmp_path):
    """The int4 GEMV compiled for sm_90 on this CPU reads its weight rows four 32-bit words a thread, for Qwen3-4B's
    2,560-column rows and SmolLM2's 576 (GGUF's 32-column blocks) alike: from K // 8 Triton could prove two words
    and one. The weight tile's second piece (SmolLM2: 64 columns, eight words a row) may read fewer."""
    pytest.importorskip("triton", reason="triton is a test dependency (pip install triton)")
    for args in (["--shape", "6144x2560"], ["--shape", "960x576", "--group", "32"]):
        out = tmp_path / "census.json"
        done = subprocess.run(
            [sys.executable, str(BENCH / "ptx_census.py"), "--kind", "int4", *args, "--json", str(out)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        r = json.loads(out.read_text())
        assert r["weight_elements_a_load"][0] == 4 and r["dp4a"] > 0 and r["instructions"] > 100
    bad = subprocess.run(
        [sys.executable, str(BENCH / "ptx_census.py"), "--shape", "6144"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "give outputs x columns" in bad.stderr and "Traceback" not in bad.stderr


def test_bench_int4_routes_names_the_route_each_projection_takes(monkeypatch):
    """bench_int4_routes.py (importable without a GPU) takes the projections' shapes from the model config and
    names the route CudaKernels.linear picks for a Qwen3-4B down projection: the GEMV at one row, Int8Rows at 16,
    the wide route at 64 and, with it switched off, the dequantization pass there; without a GPU it exits 2."""
    pytest.importorskip("triton", reason="triton is a test dependency (pip install triton)")
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_int4_routes", BENCH / "bench_int4_routes.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shapes = bench.projections(bench.CONFIGS["qwen3-4b"])
    assert shapes == {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
    from flashnext.core.precision import Int4Weight
    from flashnext.plugins.cuda.kernels import CudaKernels

    down = Int4Weight(torch.zeros(2560, 4864, dtype=torch.uint8), torch.ones(2560, 76), torch.zeros(2560, 76), 128)
    kernels = CudaKernels()
    assert [bench.route(kernels, torch.zeros(r, 9728, dtype=torch.bfloat16), down) for r in (1, 16, 64)] == [
        "gemv",
        "int8 rows",
        "wide",
    ]
    monkeypatch.setattr(CudaKernels, "_wide_int4", lambda self, x, w: False)
    assert bench.route(kernels, torch.zeros(64, 9728, dtype=torch.bfloat16), down) == "pass + bf16"
    if not torch.cuda.is_available():
        assert bench.main(["--shapes", "qwen3-4b"]) == 2  # a clear line, no traceback


def test_bench_cpu_offset_terms_layouts_compute_the_same_projections():
    """The offset-term benchmark times equal work: its exact layouts give one chain's outputs, which a float64
    recomputation from the same codes, scales and offsets matches; the floor without any offset term does not."""
    pytest.importorskip("onnxruntime")
    spec = importlib.util.spec_from_file_location("bench_offsets", BENCH / "bench_cpu_offset_terms.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    x = np.random.default_rng(3).standard_normal((1, 576)).astype(np.float32)
    out = {lay: bench.session(lay, 1, 1, layers=1).run(None, {"x": x})[0] for lay in bench.LAYOUTS}
    rng, h = np.random.default_rng(0), x.astype(np.float64)
    for k, n in bench.WIDTHS:  # the chain's draws in its order: codes, scales, offsets a projection
        groups = k // bench.GROUP
        codes = rng.integers(0, 256, (n, groups, bench.GROUP // 2), dtype=np.uint8)
        scales = (rng.random(n * groups, dtype=np.float32) * 0.01 + 0.001).reshape(n, groups, 1)
        offsets = (rng.random((n, groups), dtype=np.float32) - 0.5) * 0.01
        q = np.stack([codes & 15, codes >> 4], axis=-1).reshape(n, groups, bench.GROUP)  # low nibble first
        w = (q.astype(np.float64) - 8) * scales + offsets[..., None]
        h = h @ w.reshape(n, k).T
    for layout in ("matmul-gemm", "reduce-gemm", "rows-split"):
        assert np.allclose(out[layout], h, rtol=1e-3, atol=1e-3 * np.abs(h).max()), layout
    assert not np.allclose(out["none"], h, rtol=1e-3, atol=1e-3 * np.abs(h).max())


def test_bench_cpu_vs_hf_names_a_llamacpp_that_dies_instead_of_dying_with_it(tmp_path):
    """A llama.cpp build that crashes on this CPU ends the comparison with one line naming the signal and the way
    out; one that decodes passes the check."""
    spec = importlib.util.spec_from_file_location("bench_vs", BENCH / "bench_cpu_vs_hf.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    gguf = tmp_path / "model.gguf"
    with pytest.raises(SystemExit, match=r"died decoding two tokens of model\.gguf \(signal SIGSEGV\).*--engines"):
        bench.check_llamacpp_decodes(gguf, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(SystemExit, match=r"\(exit code 3\)"):
        bench.check_llamacpp_decodes(gguf, "raise SystemExit(3)")
    bench.check_llamacpp_decodes(gguf, "import sys; assert sys.argv[1].endswith('model.gguf')")
