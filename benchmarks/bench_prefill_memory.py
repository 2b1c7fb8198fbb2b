"""Peak activation memory of one long prefill, unchunked vs chunked.

Each mode runs in a fresh child process, so one mode's allocator state cannot hide or inflate the other's. The
child loads the model, runs a short warm-up (lazily expanded weights, allocator pools), writes every KV-cache page
(so cache pages touched by the prefill are not counted as activations), then measures only the prefill:

- cpu: the peak resident set (Linux VmHWM) is reset by writing 5 to /proc/self/clear_refs just before the prefill;
  peak minus the RSS at that point is what the prefill added. RSS sees every allocation torch makes (tracemalloc
  sees none of them), and a high-water mark cannot miss a short-lived peak the way sampling can. The child runs
  with glibc's mmap threshold fixed at 1 MiB, so freed activations leave the resident set at once.
- cuda: torch.cuda.reset_peak_memory_stats, then max_memory_allocated minus memory_allocated before the prefill.

    python benchmarks/bench_prefill_memory.py --backend cpu --prompt-len 4096 --chunk 256 --json out.json
    python benchmarks/bench_prefill_memory.py --backend cuda --shape smollm2-135m --prompt-len 4096 --chunk 256
"""

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch

from flashnext.core.cli_bench import SHAPES, load_bench_model

MIB = 1 << 20
# glibc serves allocations of 1 MiB and up with their own mappings, unmapped on free. Left to itself it raises that
# threshold after each free (up to 32 MiB) and keeps freed heap memory resident, so the high-water mark would
# depend on allocation history, not only on what is alive at once.
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cpu")
    p.add_argument("--model", help="model path or HF id (default: the embedded SmolLM2-135M)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="random weights of this model's shape instead of --model")
    p.add_argument("--precision")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=256, help="tokens per prefill chunk (max_num_batched_tokens)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--child", choices=["unchunked", "chunked"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.model and args.shape:
        p.error("give --model or --shape, not both")
    return args


def proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class CpuPeak:
    def start(self) -> int:
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return proc_status_kib("VmRSS") * 1024

    def peak(self) -> int:
        return proc_status_kib("VmHWM") * 1024


class CudaPeak:
    def start(self) -> int:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()


def measure(args) -> dict:
    """Runs in the child: one prefill in the given mode, returns the measured bytes."""
    from flashnext.core.engine.engine import GIB
    from flashnext.core.engine.sequence import SamplingParams
    from flashnext.core.llm import LLM

    chunked = args.child == "chunked"
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_bench_model(args.model, args.shape)
    cfg = loaded.config
    # A KV cache just big enough for the prompt (fp32-sized), so the cache stays small next to activations.
    kv_bytes = (args.prompt_len + 64) * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    llm = LLM(
        model=loaded,
        backend=args.backend,
        precision=args.precision,
        profile="full",
        chunked_prefill=chunked,
        max_num_batched_tokens=args.chunk if chunked else args.prompt_len,
        max_num_seqs=1,
        kv_cache_max_gib=kv_bytes / GIB,
    )
    engine = llm.engine
    engine.generate([list(range(100, 164))], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    for k_cache, v_cache in engine.runner.kv_caches:
        k_cache.zero_()
        v_cache.zero_()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, engine.config.vocab_size, (args.prompt_len,), generator=g).tolist()
    meter = CudaPeak() if engine.model.device.type == "cuda" else CpuPeak()
    seq = engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    before = meter.start()
    start = time.perf_counter()
    steps = 0
    while seq.finish_reason is None:
        engine.step()
        steps += 1
    prefill_s = time.perf_counter() - start
    peak = meter.peak()
    return {
        "mode": args.child,
        "chunk": args.chunk if chunked else args.prompt_len,
        "steps": steps,
        "baseline_bytes": before,
        "peak_bytes": peak,
        "activation_peak_bytes": peak - before,
        "prefill_s": prefill_s,
        "kv_cache_bytes": engine.blocks.num_blocks
        * engine.runner.kv_bytes_per_block(engine.model, engine.profile.block_size, engine.kv_dtype),
        "backend": llm.info.backend,
        "model": llm.loaded.name,
        "precision": engine.precision.name,
        "device": str(engine.model.device),
        "threads": torch.get_num_threads(),
        "method": "cuda max_memory_allocated" if isinstance(meter, CudaPeak) else "linux VmHWM after clear_refs",
    }


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)))
        return None
    runs = {}
    for mode in ("unchunked", "chunked"):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--backend",
            args.backend,
            "--prompt-len",
            str(args.prompt_len),
            "--chunk",
            str(args.chunk),
        ]
        cmd += ["--model", args.model] if args.model else []
        cmd += ["--shape", args.shape] if args.shape else []
        cmd += ["--precision", args.precision] if args.precision else []
        cmd += ["--threads", str(args.threads)] if args.threads else []
        done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | FIXED_MMAP_THRESHOLD)
        if done.returncode != 0:
            sys.exit(f"{mode} run failed:\n{done.stderr[-2000:]}")
        runs[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    whole, chunked = runs["unchunked"], runs["chunked"]
    ratio = chunked["activation_peak_bytes"] / whole["activation_peak_bytes"]
    print(
        f"{whole['backend']} · {whole['model']} · {whole['precision']} · prompt {args.prompt_len} tokens · "
        f"{whole['method']}"
    )
    print(f"{'mode':<10} {'chunk':>6} {'steps':>6} {'activation peak MiB':>20} {'prefill s':>10}")
    for r in (whole, chunked):
        print(
            f"{r['mode']:<10} {r['chunk']:>6} {r['steps']:>6} {r['activation_peak_bytes'] / MIB:>20.1f} "
            f"{r['prefill_s']:>10.2f}"
        )
    print(f"chunked / unchunked activation peak: {ratio:.3f}")
    result = {
        "bench": "prefill_memory",
        "prompt_len": args.prompt_len,
        "chunk": args.chunk,
        "ratio": ratio,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "flashnext_version": version("flashnext"),
        "machine": machine(whole),
        "runs": [whole, chunked],
    }
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


def machine(run: dict) -> str:
    if run["device"].startswith("cuda"):
        return f"{platform.node()} / {torch.cuda.get_device_name(0)}"
    return f"{platform.node()} / {platform.machine()} ({run['threads']} threads)"


if __name__ == "__main__":
    main()
