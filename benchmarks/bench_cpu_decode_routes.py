"""CPU int4 decode by route: the fp16 expansion (torch) against one onnxruntime MatMulNBits graph a step (float32
activations, int8 into the MLP projections, or int8 throughout), the graph's pool as shipped or with a suffix:
`-sleep` (idle pool threads sleep at once) or `-spin` (onnxruntime's unbounded spinning).

The embedded SmolLM2 (int4) in engines that differ only in `int4_route` (and, for onnxruntime, how its pool
waits), at each thread count; each round runs every engine once (the order rotates) on the same requests:
`--batch` requests of a `--prompt-len`-token prompt, greedy, `--gen-len` new tokens, decode tok/s = (new tokens - 1)
a request x batch / time from the first step that returned tokens to the last. Medians over rounds, the load
average before and after; compare routes within one run only. `--busy` keeps one core busy with another process
(a Python busy loop) throughout, to show what a loaded neighbour costs each route.

`--numerics` measures instead how far each route's logits are from the exact int4 model (the Q4_1 weights
dequantized to fp32, fp32 activations: precision fp32 on the same file): three prompts, their last position and
then 8 teacher-forced decode steps, mean and largest NMSE, and how often the greedy token differs. The route
`llama.cpp` (where llama-cpp-python is installed) is llama.cpp on the same GGUF, for comparison (speed: batch 1).

    python benchmarks/bench_cpu_decode_routes.py --threads 1,2 --rounds 5 --json out.json
    python benchmarks/bench_cpu_decode_routes.py --threads 2 --busy --json out_busy.json
    python benchmarks/bench_cpu_decode_routes.py --numerics --routes torch,onnxruntime,onnxruntime-int8,llama.cpp
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_cpu_vs_hf import QUIET_S, llamacpp_runner  # noqa: E402

from flashnext.core.engine.sequence import SamplingParams  # noqa: E402
from flashnext.core.llm import LLM  # noqa: E402
from flashnext.core.loader import default_model_path, load_model  # noqa: E402
from numerics import step_logits  # noqa: E402

PROSE = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined type. "
ROUTES = (
    "torch",
    "native",
    "onnxruntime",
    "onnxruntime-mlp-int8",
    "onnxruntime-int8",
    "onnxruntime-sleep",
    "onnxruntime-spin",
)
POOL_SPIN_US = {"-sleep": 0, "-spin": None}  # a route's suffix: CpuRunner.pool_spin_us


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument("--routes", default=",".join(ROUTES), help="from: " + ", ".join(ROUTES))
    p.add_argument("--batch", default="1", help="requests decoding together, comma-separated")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--busy", action="store_true", help="keep one core busy with a busy-loop process")
    p.add_argument("--numerics", action="store_true", help="logits against the exact int4 model instead of speed")
    p.add_argument("--json", dest="json_path", help="write the rows here")
    return p.parse_args(argv)


def engine_for(loaded, route: str, threads: int, max_len: int, batch: int, precision: str = "int4"):
    llm = LLM(
        loaded,
        backend="cpu",
        precision=precision,
        threads=threads,
        int4_route=route.removesuffix("-sleep").removesuffix("-spin"),
        max_model_len=max_len,
        max_num_seqs=batch,
        prefix_caching=False,
    )
    for suffix, spin_us in POOL_SPIN_US.items():
        if route.endswith(suffix):
            llm.engine.runner.pool_spin_us = spin_us
    return llm.engine


def decode_rate(engine, ids: list[int], gen_len: int, batch: int) -> float:
    if callable(engine):  # llama.cpp
        return engine(ids, gen_len)
    for _ in range(batch):
        engine.add_request(ids, SamplingParams(max_tokens=gen_len, ignore_eos=True))
    times, tokens = [], 0
    while engine.has_work():
        got = sum(len(out.new_token_ids) for out in engine.step())
        if got:
            times.append(time.perf_counter())
            tokens += got
    return (tokens - batch) / (times[-1] - times[0])


def main(argv=None):
    args = parse_args(argv)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        rows = numerics(args) if args.numerics else run(args)
    finally:
        if busy is not None:
            busy.kill()
    for r in rows:
        if args.numerics:
            print(
                f"{r['route']:>17}: logits NMSE vs exact int4 mean {r['nmse_mean']:.1e} max {r['nmse_max']:.1e}, "
                f"greedy token differs at {r['greedy_differs']} of {r['positions']} positions"
            )
            continue
        print(
            f"threads {r['threads']} batch {r['batch']} {r['route']:>17}: decode {r['decode_tok_s']:.1f} tok/s "
            f"(rounds {', '.join(f'{x:.1f}' for x in r['rounds'])}), ×torch {r.get('vs_torch', float('nan')):.2f}"
        )
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(rows, indent=2))
    return rows


def run(args) -> list[dict]:
    loaded = load_model(None)
    ids = loaded.tokenizer.encode(PROSE * (1 + args.prompt_len // 20))[: args.prompt_len]
    max_len = args.prompt_len + args.gen_len + 16
    load_before = os.getloadavg()
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)  # llama.cpp's runner takes torch's count
        for batch in (int(b) for b in args.batch.split(",")):
            routes = args.routes.split(",")
            engines = {
                r: llamacpp_decoder(max_len) if r == "llama.cpp" else engine_for(loaded, r, threads, max_len, batch)
                for r in routes
            }
            samples = {r: [] for r in routes}
            for engine in engines.values():  # warm-up: graph build, fp16 expansion, thread pools
                torch.set_num_threads(threads)
                decode_rate(engine, ids, 8, batch)
            for i in range(args.rounds):
                for route in routes[i % len(routes) :] + routes[: i % len(routes)]:
                    time.sleep(QUIET_S)  # the route before may leave threads spinning (-spin, llama.cpp's team)
                    torch.set_num_threads(threads)
                    samples[route].append(decode_rate(engines[route], ids, args.gen_len, batch))
            base = statistics.median(samples["torch"]) if "torch" in samples else None
            for route in routes:
                med = statistics.median(samples[route])
                row = {"threads": threads, "batch": batch, "route": route, "decode_tok_s": med}
                row["rounds"] = samples[route]
                if base:
                    row["vs_torch"] = med / base
                    row["vs_torch_median_of_rounds"] = statistics.median(
                        a / b for a, b in zip(samples[route], samples["torch"])
                    )
                rows.append(row)
            del engines
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": "SmolLM2-135M-Instruct Q4_1 (embedded), int4",
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "busy_neighbour": args.busy,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "torch": torch.__version__,
        "onnxruntime": _onnxruntime_version(),
        "logical_cpus": os.cpu_count(),
    }
    return [meta | r for r in rows]


NUMERICS_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village")


def numerics(args, steps: int = 8) -> list[dict]:
    """Each route's logits against the exact int4 model's, on the exact model's greedy tokens."""
    loaded = load_model(None)
    prompts = [loaded.tokenizer.encode(t) for t in NUMERICS_PROMPTS]
    exact_engine = engine_for(loaded, "torch", torch.get_num_threads(), 256, 1, precision="fp32")
    exact = [teacher_forced(exact_engine, p, steps) for p in prompts]
    rows = []
    for route in args.routes.split(","):
        if route == "llama.cpp":
            forward = llamacpp_forward()
        else:
            engine = engine_for(loaded, route, torch.get_num_threads(), 256, 1)
            forward = partial(teacher_forced, engine)
        errors, differs = [], 0
        for prompt, want in zip(prompts, exact):
            got = forward(prompt, steps, [int(x.argmax()) for x in want])
            errors += [float(((a - b) ** 2).mean() / (b**2).mean()) for a, b in zip(got, want)]
            differs += sum(int(a.argmax() != b.argmax()) for a, b in zip(got, want))
        rows.append(
            {
                "route": route,
                "nmse_mean": statistics.mean(errors),
                "nmse_max": max(errors),
                "greedy_differs": differs,
                "positions": len(errors),
            }
        )
    return rows


def llamacpp_decoder(max_len: int):
    """decode_rate's measure for llama.cpp on the same GGUF at batch 1 (bench_cpu_vs_hf's runner): greedy tokens a
    second after the first."""
    run = llamacpp_runner(default_model_path(), max_len)

    def rate(ids: list[int], gen_len: int) -> float:
        _, times, _ = run(ids, gen_len)
        return (len(times) - 1) / (times[-1] - times[0])

    return rate


def llamacpp_forward():
    """teacher_forced's logits from llama.cpp on the same GGUF (its own rounding: activations as Q8 blocks)."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(default_model_path()),
        n_ctx=256,
        logits_all=True,
        n_threads=torch.get_num_threads(),
        verbose=False,
    )

    def forward(prompt: list[int], steps: int, tokens: list[int]) -> list[torch.Tensor]:
        llm.reset()
        llm.eval(prompt + tokens[:steps])
        rows = torch.tensor(np.asarray(llm.scores[: len(prompt) + steps]))
        return list(rows[len(prompt) - 1 :])

    return forward


def teacher_forced(engine, prompt: list[int], steps: int, tokens: list[int] | None = None) -> list[torch.Tensor]:
    """numerics.step_logits for one prompt: its last position's logits, then each decode step's, a row each."""
    forced = [[t] for t in tokens] if tokens else None
    return [step[0] for step in step_logits(engine, [prompt], steps, forced)]


def _onnxruntime_version() -> str | None:
    try:
        import onnxruntime
    except ImportError:
        return None
    return onnxruntime.__version__


if __name__ == "__main__":
    main()
