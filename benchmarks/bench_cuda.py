"""The CUDA backend on one GPU, in one run: kernel checks, numerics, kernel timings, engine benchmarks, HF baseline.

    python benchmarks/bench_cuda.py --out DIR [--skip-hf] [--quick]

Random Qwen3-0.6B-shaped weights (flashnext.core.cli_bench.random_model). Writes DIR/bench_cuda.json (every
number) and prints a short table last. Ratios (graph vs eager, fp8 / int4 vs bf16, flashnext vs HF) come from
rows measured in this same process; the batch-64 fp8 / bf16 ratio also as the median of three interleaved rounds.
The random bf16 weights are built once on the GPU for every engine, so the peak memory of an int4 or fp8 row counts
them too (`flashnext bench --shape` reports an engine's own).
"""

import argparse
import gc
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from flashnext.core.cli_bench import bench_rows, machine_name, random_model
from flashnext.core.engine.runner import ModelRunner, RunnerSetup
from flashnext.core.engine.scheduler import ScheduledSeq
from flashnext.core.engine.sequence import SamplingParams, Sequence
from flashnext.core.kernels import ReferenceKernels
from flashnext.core.llm import LLM
from flashnext.core.model import DecoderModel
from flashnext.core.precision import PRECISIONS
from flashnext.plugins.cuda import CudaBackend

SHAPE = "qwen3-0.6b"
PROMPT, GEN = 256, 128
results: dict = {"sections": {}}
STARTED = time.perf_counter()
SWEEP_DEADLINE_S = 330  # seconds into the run after which the sweep stops (one device call is 10 minutes)


def section(name):
    def wrap(fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                out = fn(*args, **kwargs)
            except Exception:
                out = {"error": traceback.format_exc()}
                print(out["error"], flush=True)
            results["sections"][name] = out
            print(f"   ({time.perf_counter() - start:.1f} s)", flush=True)
            return out

        return run

    return wrap


def nmse(a, b):
    a, b = a.float(), b.float()
    return float((a - b).pow(2).sum() / b.pow(2).sum())


def release():
    gc.collect()
    torch.cuda.empty_cache()


def make_llm(loaded, precision="bf16", profile=None, max_num_seqs=64, **extra):
    return LLM(
        model=loaded,
        backend="cuda",
        precision=precision,
        profile=profile,
        max_model_len=PROMPT + GEN + 64,
        max_num_seqs=max_num_seqs,
        **extra,
    )


def prompt_logits(runner, prompts: list[list[int]], block_size: int) -> torch.Tensor:
    """Logits at every prompt position through runner.run (eager path), the prompts placed in fresh blocks."""
    batch, next_block = [], 0
    for p in prompts:
        seq = Sequence(list(p), SamplingParams())
        n_blocks = -(-len(p) // block_size)
        seq.block_table = list(range(next_block, next_block + n_blocks))
        next_block += n_blocks
        batch.append(ScheduledSeq(seq, len(p), len(p)))
    logits, _ = runner.run(batch)
    return logits


@section("kernel tests (pytest, compiled on the GPU)")
def kernel_tests(out_dir: Path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_cuda_kernels.py",
            "tests/test_cuda_runner.py",
        ],
        capture_output=True,
        text=True,
    )
    (out_dir / "pytest_cuda.log").write_text(proc.stdout + proc.stderr)
    summary = [line for line in proc.stdout.splitlines() if " passed" in line or " failed" in line]
    print("   ", summary[-1] if summary else proc.stdout[-2000:])
    return {"returncode": proc.returncode, "summary": summary[-1] if summary else ""}


@section("numerics: fused CUDA forward vs reference kernels; fp8 / int4 vs bf16")
def numerics(loaded):
    gen = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, loaded.config.vocab_size, (4, 64), generator=gen).tolist()
    out = {}
    ref_model = DecoderModel(
        loaded.config, loaded.weights, ReferenceKernels(), PRECISIONS["bf16"], torch.device("cuda"), torch.bfloat16
    )
    ref_logits = prompt_logits(ModelRunner(ref_model, RunnerSetup(64, 16, torch.bfloat16)), prompts, 16)
    del ref_model
    release()
    base = None
    for precision in ("bf16", "fp8-e4m3", "int4"):
        llm = make_llm(loaded, precision)
        logits = prompt_logits(llm.engine.runner, prompts, llm.profile.block_size)
        if precision == "bf16":
            base = logits
            out["bf16_fused_vs_reference_nmse"] = nmse(logits, ref_logits)
            out["bf16_fused_vs_reference_argmax_agree"] = float(
                (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()
            )
        else:
            out[f"{precision}_vs_bf16_nmse"] = nmse(logits, base)
            out[f"{precision}_vs_bf16_argmax_agree"] = float((logits.argmax(-1) == base.argmax(-1)).float().mean())
        del llm
        release()
    # fp8 KV cache (e5m2) against the bf16 cache, same bf16 weights.
    llm = make_llm(loaded, "bf16", kv_cache_dtype="fp8-e5m2")
    logits = prompt_logits(llm.engine.runner, prompts, llm.profile.block_size)
    out["kv_fp8_e5m2_vs_bf16_nmse"] = nmse(logits, base)
    out["kv_fp8_e5m2_vs_bf16_argmax_agree"] = float((logits.argmax(-1) == base.argmax(-1)).float().mean())
    del llm
    release()
    for k, v in out.items():
        print(f"    {k}: {v:.3g}")
    return out


@section("graph decode vs eager decode: same greedy tokens")
def graph_vs_eager(loaded):
    gen = torch.Generator().manual_seed(11)
    prompts = torch.randint(0, loaded.config.vocab_size, (6, 40), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    tokens = {}
    for profile in ("full", "basic"):
        llm = make_llm(loaded, "bf16", profile)
        seqs = llm.engine.generate(prompts, params)
        tokens[profile] = [s.output_ids for s in seqs]
        if profile == "full":
            runner = llm.engine.runner
            counters = {"graph_captures": runner.graph_captures, "graph_replays": runner.graph_replays}
        del llm
        release()
    same = sum(a == b for a, b in zip(tokens["full"], tokens["basic"]))
    prefix = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        for a, b in zip(tokens["full"], tokens["basic"])
    ]
    # Sampled (temperature > 0) decoding: seeded noise, so graphs + look-ahead must give the eager tokens too.
    sampled = {}
    sparams = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=24, ignore_eos=True, seed=5)
    for profile in ("full", "basic"):
        llm = make_llm(loaded, "bf16", profile)
        sampled[profile] = [s.output_ids for s in llm.engine.generate(prompts[:3], sparams)]
        del llm
        release()
    out = {
        "identical_sequences": same,
        "sequences": len(prompts),
        "matching_prefix_lengths": prefix,
        "sampled_identical": sum(a == b for a, b in zip(sampled["full"], sampled["basic"])),
        **counters,
    }
    print("   ", out)
    return out


def cuda_time_us(fn, iters=200) -> float:
    """Median-free mean over a CUDA graph of `iters` calls: launch gaps excluded, as in a captured decode step."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return sorted(times)[2]


@section("kernel timings at batch 1 (one layer of the Qwen3-0.6B shape, us per call inside a graph)")
def kernel_timings(loaded):
    from flashnext.plugins.cuda.kernels import CudaKernels

    llm = make_llm(loaded, "bf16")
    model, k = llm.engine.model, CudaKernels()
    cfg, layer = model.config, model.layers[0]
    dev = torch.device("cuda")
    x = torch.randn(1, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    res = torch.randn_like(x)
    act = torch.randn(1, cfg.intermediate_size, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(1, 2 * cfg.intermediate_size, device=dev, dtype=torch.bfloat16)
    qkv = torch.randn(1, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, device=dev, dtype=torch.bfloat16)
    attn = torch.randn(1, cfg.num_heads * cfg.head_dim, device=dev, dtype=torch.bfloat16)
    hidden = torch.randn(1, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    kc, vc = llm.engine.runner.kv_caches[0]
    pos = torch.tensor([300], device=dev)
    slot = torch.tensor([300], device=dev)
    from flashnext.core.kernels import AttentionMetadata

    meta = AttentionMetadata(
        slot,
        torch.tensor([0, 1], dtype=torch.int32, device=dev),
        torch.tensor([384], dtype=torch.int32, device=dev),
        torch.arange(24, dtype=torch.int32, device=dev).unsqueeze(0),
        1,
        384,
    )

    def rope_store():
        return k.qkv_rope_store(
            qkv,
            layer.q_norm,
            layer.k_norm,
            1e-6,
            pos,
            model.cos_sin,
            kc,
            vc,
            slot,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )

    q = rope_store()
    split = CudaKernels(decode_splits=16)
    t = {
        "fused add_rmsnorm+qkv gemv": cuda_time_us(lambda: k.norm_linear(x, res, layer.input_norm, 1e-6, layer.qkv)),
        "add_rmsnorm (triton)": cuda_time_us(lambda: k.add_rmsnorm(x, res, layer.input_norm, 1e-6)),
        "qkv F.linear (cublas)": cuda_time_us(lambda: torch.nn.functional.linear(x, layer.qkv)),
        "qk-norm+rope+kv write": cuda_time_us(rope_store),
        "attention ctx 384 (1 split)": cuda_time_us(lambda: k.attention(q, kc, vc, meta, model.scale)),
        "attention ctx 384 (16 splits)": cuda_time_us(lambda: split.attention(q, kc, vc, meta, model.scale)),
        "o F.linear": cuda_time_us(lambda: torch.nn.functional.linear(attn, layer.o)),
        "fused add_rmsnorm+gate_up gemv+silu": cuda_time_us(
            lambda: k.norm_linear(x, res, layer.post_norm, 1e-6, layer.gate_up, silu=True)
        ),
        "gate_up F.linear": cuda_time_us(lambda: torch.nn.functional.linear(x, layer.gate_up)),
        "silu_and_mul": cuda_time_us(lambda: k.silu_and_mul(gu)),
        "down F.linear": cuda_time_us(lambda: torch.nn.functional.linear(act, layer.down)),
        "lm_head F.linear (vocab 151936)": cuda_time_us(lambda: model.compute_logits(hidden), iters=50),
        "argmax over vocab": cuda_time_us(lambda: torch.randn(1, cfg.vocab_size, device=dev).argmax(-1), iters=50),
    }
    weight_bytes = {
        "fused add_rmsnorm+qkv gemv": layer.qkv.numel() * 2,
        "qkv F.linear (cublas)": layer.qkv.numel() * 2,
        "fused add_rmsnorm+gate_up gemv+silu": layer.gate_up.numel() * 2,
        "gate_up F.linear": layer.gate_up.numel() * 2,
        "o F.linear": layer.o.numel() * 2,
        "down F.linear": layer.down.numel() * 2,
        "lm_head F.linear (vocab 151936)": model.lm_head.numel() * 2,
    }
    out = {}
    for name, us in t.items():
        gbs = weight_bytes.get(name, 0) / (us * 1e-6) / 1e9 if name in weight_bytes else None
        out[name] = {"us": round(us, 2), "weight_GB_s": round(gbs, 0) if gbs else None}
        print(f"    {name:42s} {us:8.2f} us" + (f"  {gbs:7.0f} GB/s" if gbs else ""))
    del llm
    release()
    return out


def decode_step_profile(llm, bucket: int) -> dict:
    """GPU time of one captured decode step (graph replays, context ~300) and its kernel launches."""
    runner = llm.engine.runner
    seqs = []
    for j in range(bucket):
        seq = Sequence(list(range(300)), SamplingParams(max_tokens=10_000, ignore_eos=True))
        seq.token_ids.append(1)
        seq.num_computed = 300
        seq.block_table = list(range(j * 24, j * 24 + 24))  # 384 slots each
        seqs.append(ScheduledSeq(seq, 1, 1))
    greedy_key = (bucket, True, "decode")
    runner._fill_inputs(seqs, bucket)
    graph = runner.graphs.get(greedy_key) or runner._capture(greedy_key, lambda: runner._decode_body(bucket, True), 1)
    times = []
    for _ in range(4):
        runner._fill_inputs(seqs, bucket)
        runner.step_index.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(16):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / 16)
    step_us = sorted(times)[1]
    # Launch count and per-kernel time: the same step run eagerly under the profiler, with the graph's settings.
    runner._fill_inputs(seqs, bucket)
    runner.step_index.zero_()
    from torch.profiler import ProfilerActivity, profile

    with runner.graph_settings(bucket, 1), profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner._decode_body(bucket, True)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict = {}
    for e in events:
        name = e.name[:60]
        item = by_name.setdefault(name, [0, 0.0])
        item[0] += 1
        item[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
    return {
        "bucket": bucket,
        "graph_step_us": round(step_us, 1),
        "tok_s_gpu_only": round(bucket * 1e6 / step_us, 0),
        "kernels_per_step": len(events),
        "top_kernels_eager_us": {n: {"count": c, "us": round(us, 1)} for n, (c, us) in top},
    }


def rotating_time_us(fn_for_layer, layers: int, iters: int = 112) -> float:
    """Per-call time with the weights of `layers` layers taken in turn, so they stream from HBM, not L2."""
    calls = [0]

    def step():
        fn_for_layer(calls[0] % layers)
        calls[0] += 1

    return cuda_time_us(step, iters=iters)


@section("GEMM variants, weights streamed from HBM (us per call inside a graph)")
def gemm_sweep(loaded):
    from flashnext.plugins.cuda.kernels import CudaKernels
    from flashnext.plugins.cuda.launch import gemv_config, skinny_config

    k, out = CudaKernels(), {}
    dev = torch.device("cuda")
    for precision in ("bf16", "fp8-e4m3", "int4"):
        llm = make_llm(loaded, precision)
        model = llm.engine.model
        cfg, layers = model.config, model.layers
        widths = {
            "qkv": cfg.hidden_size,
            "o": cfg.num_heads * cfg.head_dim,
            "gate_up": cfg.hidden_size,
            "down": cfg.intermediate_size,
        }
        for rows in (1, 64):
            for name, width in widths.items():
                if time.perf_counter() - STARTED > SWEEP_DEADLINE_S:
                    print("    (sweep stopped: time budget of this run)")
                    return out
                x = torch.randn(rows, width, device=dev, dtype=torch.bfloat16)
                weight = lambda i, name=name: getattr(layers[i], name)  # noqa: E731
                w0 = weight(0)
                variants = {}
                if precision == "bf16":
                    variants["cublas"] = lambda i: torch.nn.functional.linear(x, weight(i))
                if precision == "fp8-e4m3":
                    variants["scaled_mm w8a8"] = lambda i: k._fp8_linear(x, weight(i))
                if rows <= 2:
                    default = gemv_config(w0.shape[0], width, k._weight_kind(w0)[0])
                    variants[f"register gemv {default}"] = lambda i: k.gemv(x, weight(i))
                    for conf in ((4, 4), (16, 8)):
                        variants[f"register gemv {conf}"] = lambda i, c=conf: k.gemv(x, weight(i), config=c)
                if precision == "int4":
                    variants["dequant+cublas"] = lambda i: torch.nn.functional.linear(
                        x, k.int4_dequantize(weight(i), x.dtype)
                    )
                    if rows > 2:  # what linear does with a batch: the dequantization pass, then the skinny GEMM
                        variants["linear: dequant+skinny"] = lambda i: k.linear(x, weight(i))
                else:
                    chosen = skinny_config(w0.shape[0], width, rows, k._weight_kind(w0)[1].element_size())
                    variants[f"skinny {chosen}"] = lambda i: k.skinny_gemm(x, weight(i))
                    for conf in ((16, 256, 4, 1), (32, 128, 4, 1), (64, 128, 3, 1)):
                        if conf != chosen:
                            variants[f"skinny {conf}"] = lambda i, c=conf: k.skinny_gemm(x, weight(i), config=c)
                row = {}
                for vname, fn in variants.items():
                    try:
                        row[vname] = round(rotating_time_us(fn, len(layers)), 2)
                    except Exception as exc:
                        row[vname] = f"error: {str(exc)[:100]}"
                timed = {v: t for v, t in row.items() if isinstance(t, float)}
                best = min(timed, key=timed.get) if timed else None
                out[f"{precision} rows={rows} {name}"] = row
                print(
                    f"    {precision:8s} rows={rows:2d} {name:8s} best {best} {timed.get(best, 0):6.2f} us | "
                    + " ".join(
                        f"{v.split(' ', 1)[0][:4]}{v[v.find('(') :] if '(' in v else ''}={t}" for v, t in row.items()
                    ),
                    flush=True,
                )
        del llm
        release()
    return out


@section("engine benchmarks (flashnext bench rows)")
def engine_benchmarks(loaded, quick: bool):
    rows, steps = [], []
    results["engine_rows"], results["decode_steps"] = rows, steps
    # Without the fused register GEMV: bf16 projections through cuBLAS, quantized ones through the skinny GEMM.
    unfused = {
        "variant": "no-fused-gemv",
        "configure": lambda llm: vars(llm.engine.model.kernels).update(register_gemv=False, skinny_dense=False),
    }
    fp8_kv = {"variant": "kv-fp8-e5m2", "kv_cache_dtype": "fp8-e5m2"}
    fp8_head = {"variant": "kv-e5m2+fp8head", "kv_cache_dtype": "fp8-e5m2", "quantize_lm_head": True}
    int4_fp8_head = {"variant": "fp8head", "quantize_lm_head": True}  # the opt-in 8-bit head of int4 weights
    configs = [
        ("bf16", "full", [1, 8, 64], {}),
        ("bf16", "full", [1], unfused),
        ("bf16", "basic", [1, 64], {}),
        ("fp8-e4m3", "full", [1, 64], {}),
        ("fp8-e4m3", "full", [64], fp8_kv),
        ("fp8-e4m3", "full", [64], fp8_head),
        ("bf16", "full", [64], fp8_kv),
        ("int4", "full", [1, 64], {}),
        ("int4", "full", [1], int4_fp8_head),
    ]
    if quick:
        configs = [c for c in configs if c[1] == "full"]
    for precision, profile, sizes, extra in configs:
        extra = dict(extra)
        variant = extra.pop("variant", "default")
        try:
            r = bench_rows(loaded, "cuda", precision, profile, sizes, PROMPT, GEN, **extra)
        except Exception:
            print(traceback.format_exc())
            continue
        for row in r:
            row["variant"] = variant
        rows += r
        for row in r:
            print(
                f"    {precision:9s} {profile:6s} {variant:12s} b={row['batch_size']:3d} ttft={row['ttft_s']:.4f}s "
                f"decode={row['decode_tok_s']:9.1f} tok/s e2e={row['throughput_tok_s']:9.1f} tok/s",
                flush=True,
            )
        if profile == "full" and variant == "default":
            llm = make_llm(loaded, precision, "full", max_num_seqs=64)
            for b in (1, 64):
                try:
                    p = decode_step_profile(llm, b) | {"precision": precision}
                except Exception:
                    p = {"bucket": b, "precision": precision, "error": traceback.format_exc()}
                    print(p["error"])
                    continue
                steps.append(p)
                print(
                    f"    step {precision} b={b}: {p['graph_step_us']} us/step on GPU, {p['kernels_per_step']} kernels",
                    flush=True,
                )
            del llm
        release()
    return {"rows": rows, "decode_steps": steps}


RATIO_ROUNDS = 3
FP8_RATIO_ROWS = {
    "bf16": ("bf16", {}),
    "fp8+fp8kv": ("fp8-e4m3", {"kv_cache_dtype": "fp8-e5m2"}),
    "fp8+fp8kv+fp8 head": ("fp8-e4m3", {"kv_cache_dtype": "fp8-e5m2", "quantize_lm_head": True}),
}


@section(f"fp8 / bf16 decode at batch 64, {RATIO_ROUNDS} interleaved rounds")
def fp8_ratio_rounds(loaded):
    """The batch-64 decode rows behind the fp8 target again, interleaved round by round: one 128-token decode of
    64 requests moves by 1-2% from run to run, so a single pair of rows can land on either side of 1.3x."""
    rates: dict[str, list[float]] = {name: [] for name in FP8_RATIO_ROWS}
    for _ in range(RATIO_ROUNDS):
        for name, (precision, extra) in FP8_RATIO_ROWS.items():
            row = bench_rows(loaded, "cuda", precision, "full", [64], PROMPT, GEN, **extra)[0]
            rates[name].append(row["decode_tok_s"])
            release()
    out = {"decode_tok_s": rates}
    for name in list(FP8_RATIO_ROWS)[1:]:
        per_round = sorted(a / b for a, b in zip(rates[name], rates["bf16"]))
        out[f"{name}/bf16"] = {"median": per_round[len(per_round) // 2], "min": per_round[0], "max": per_round[-1]}
        print(f"    {name}/bf16 decode b=64 per round: {[round(r, 3) for r in per_round]}", flush=True)
    results["fp8_ratio_rounds"] = out
    return out


@section("HF transformers generate_batch baseline (64 x 256 in, 128 out)")
def hf_baseline(loaded):
    import transformers
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = loaded.config
    hf_cfg = Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=True,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    out = {"transformers": transformers.__version__}
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, cfg.vocab_size, (64, PROMPT), generator=gen).tolist()
    config = GenerationConfig(max_new_tokens=GEN, do_sample=False, eos_token_id=None, pad_token_id=0)
    warm = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(hf_cfg).to(dtype=torch.bfloat16).eval()
    for impl in (None, "sdpa_paged", "paged|sdpa"):
        try:
            if impl:  # older names for the paged implementation generate_batch needs
                model.config._attn_implementation = impl
            model.generate_batch(inputs=prompts[:8], generation_config=warm, progress_bar=False)
            out["attn_implementation"] = model.config._attn_implementation
            break
        except Exception as exc:
            out.setdefault("attn_errors", []).append(f"{impl}: {exc!r}"[:300])
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    produced = sum(len(r.generated_tokens) for r in result.values())
    out |= {"wall_s": wall, "output_tokens": produced, "throughput_tok_s": produced / wall}
    print(f"    HF generate_batch: {produced} tokens in {wall:.2f} s = {produced / wall:.1f} tok/s")
    del model
    release()
    return out


def summary(res: dict) -> list[str]:
    rows = {
        (r["precision"], r["profile"], r.get("variant", "default"), r["batch_size"]): r
        for r in res.get("engine_rows", [])
    }
    hf = res["sections"].get("HF transformers generate_batch baseline (64 x 256 in, 128 out)", {})

    def get(p, prof, b, key, variant="default"):
        r = rows.get((p, prof, variant, b))
        return r[key] if r else float("nan")

    lines = [
        f"{'precision':9s} {'profile':7s} {'variant':12s} {'batch':>5s} {'ttft s':>8s} {'decode tok/s':>13s} "
        f"{'e2e tok/s':>10s}"
    ]
    for (p, prof, variant, b), r in rows.items():
        lines.append(
            f"{p:9s} {prof:7s} {variant:12s} {b:5d} {r['ttft_s']:8.4f} {r['decode_tok_s']:13.1f} "
            f"{r['throughput_tok_s']:10.1f}"
        )
    decode = "decode_tok_s"
    ratios = {
        "graph/eager decode b=1": get("bf16", "full", 1, decode) / get("bf16", "basic", 1, decode),
        "graph/eager decode b=64": get("bf16", "full", 64, decode) / get("bf16", "basic", 64, decode),
        "fp8/bf16 decode b=64": get("fp8-e4m3", "full", 64, decode) / get("bf16", "full", 64, decode),
        "fp8+fp8kv/bf16 decode b=64": get("fp8-e4m3", "full", 64, decode, "kv-fp8-e5m2")
        / get("bf16", "full", 64, decode),
        "fp8+fp8kv+fp8 head/bf16 decode b=64": get("fp8-e4m3", "full", 64, decode, "kv-e5m2+fp8head")
        / get("bf16", "full", 64, decode),
        "int4/bf16 decode b=1": get("int4", "full", 1, decode) / get("bf16", "full", 1, decode),
        "int4+fp8 head/bf16 decode b=1": get("int4", "full", 1, decode, "fp8head") / get("bf16", "full", 1, decode),
    }
    for name, spread in res.get("fp8_ratio_rounds", {}).items():
        if name != "decode_tok_s":
            ratios[f"{name} decode b=64, median of {RATIO_ROUNDS}"] = spread["median"]
    if hf.get("throughput_tok_s"):
        ratios["flashnext/HF e2e 64x(256,128)"] = get("bf16", "full", 64, "throughput_tok_s") / hf["throughput_tok_s"]
    res["ratios"] = ratios
    lines += [f"{k:32s} {v:8.2f}x" for k, v in ratios.items()]
    for name, spread in res.get("fp8_ratio_rounds", {}).items():
        if name != "decode_tok_s":
            lines.append(f"  {name} over {RATIO_ROUNDS} rounds: {spread['min']:.3f} .. {spread['max']:.3f}")
    return lines


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--quick", action="store_true", help="bf16 engine rows only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    results["machine"] = machine_name(CudaBackend())
    results["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results["torch"] = torch.__version__
    if not args.skip_tests:
        kernel_tests(args.out)
    loaded = random_model(SHAPE, dev)
    engine_benchmarks(loaded, args.quick)
    if not args.quick:
        fp8_ratio_rounds(loaded)
    (args.out / "bench_cuda.json").write_text(json.dumps(results, indent=2, default=str))
    numerics(loaded)
    if not args.quick:
        graph_vs_eager(loaded)
    kernel_timings(loaded)
    if not args.skip_hf:
        hf_baseline(loaded)
    (args.out / "bench_cuda.json").write_text(json.dumps(results, indent=2, default=str))
    gemm_sweep(loaded)
    lines = summary(results)
    (args.out / "bench_cuda.json").write_text(json.dumps(results, indent=2, default=str))
    print("\n".join(["", f"{results['machine']}  {results['date']}", *lines]))


if __name__ == "__main__":
    main()
