"""Serving throughput through the Python API: N requests of mixed prompt / output lengths.

Reports output tok/s, request/s, TTFT and inter-token latency percentiles (p50/p90/p99). Prompts are distinct random
tokens (the prefix cache never helps) and every request generates its drawn output length (EOS ignored), so a run
is repeatable for a given --seed. Requests arrive all at once (offline batch) or as a Poisson process with
--request-rate.

    python benchmarks/bench_engine.py --backend cpu --num-requests 16 --json out.json         # the embedded model
    python benchmarks/bench_engine.py --backend cuda --shape qwen3-0.6b --num-requests 512     # random weights
"""

import argparse
import json
import math
import random
import time
from importlib.metadata import version

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from flashnext.core.cli_bench import SHAPES, load_bench_model, machine_name
from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.llm import LLM


def length_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    low, high = int(low), int(high or low)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"'{text}' is not MIN,MAX with 1 <= MIN <= MAX")
    return low, high


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto")
    p.add_argument("--model", help="model path or HF id (default: the embedded SmolLM2-135M)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="random weights of this model's shape instead of --model")
    p.add_argument("--precision")
    p.add_argument("--profile")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=length_range, default=(32, 512), help="MIN,MAX prompt tokens (uniform)")
    p.add_argument("--output-len", type=length_range, default=(16, 128), help="MIN,MAX output tokens (uniform)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson; inf = all at once")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", dest="json_path", help="write the result object here")
    args = p.parse_args(argv)
    if args.model and args.shape:
        p.error("give --model or --shape, not both")
    return args


def workload(args, vocab: int) -> list[tuple[float, list[int], int]]:
    """(arrival offset s, prompt ids, output length) per request, drawn from --seed."""
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for _ in range(args.num_requests):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*args.prompt_len))]
        out.append((t, prompt, rng.randint(*args.output_len)))
        if math.isfinite(args.request_rate):
            t += rng.expovariate(args.request_rate)
    return out


def serve(llm: LLM, requests) -> tuple[float, list[dict]]:
    """Feeds requests at their arrival times and steps the engine; records every token's time per request."""
    engine, pending, live = llm.engine, list(requests), {}
    start = time.perf_counter()
    while pending or engine.has_work():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            arrival, prompt, n_out = pending.pop(0)
            seq = engine.add_request(prompt, SamplingParams(max_tokens=n_out, ignore_eos=True))
            live[id(seq)] = {"seq": seq, "arrival": arrival, "token_times": []}
        if not engine.has_work():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        outputs = engine.step()
        stamp = time.perf_counter() - start
        for out in outputs:
            live[id(out.seq)]["token_times"] += [stamp] * len(out.new_token_ids)
    return time.perf_counter() - start, list(live.values())


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
    return {"p50": p50, "p90": p90, "p99": p99, "mean": float(np.mean(values))}


def summarize(wall_s: float, records: list[dict]) -> dict:
    ttft = [r["token_times"][0] - r["arrival"] for r in records]
    itl = [b - a for r in records for a, b in zip(r["token_times"], r["token_times"][1:])]
    e2e = [r["token_times"][-1] - r["arrival"] for r in records]
    out_tokens = sum(len(r["seq"].output_ids) for r in records)
    prompt_tokens = sum(r["seq"].num_prompt for r in records)
    return {
        "wall_s": wall_s,
        "requests_per_s": len(records) / wall_s,
        "output_tok_s": out_tokens / wall_s,
        "total_tok_s": (out_tokens + prompt_tokens) / wall_s,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "ttft_s": percentiles(ttft),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles(e2e),
    }


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_bench_model(args.model, args.shape, seed=args.seed)
    overrides = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    llm = LLM(model=loaded, backend=args.backend, precision=args.precision, profile=args.profile, **overrides)
    vocab = llm.engine.config.vocab_size
    serve(llm, [(0.0, [1 + i for i in range(16)], 4), (0.0, [7] * 40, 4)])  # warm-up: caches, lazy weights
    requests = workload(args, vocab)
    engine = llm.engine
    preempt0, chunks0 = engine.scheduler.preemptions, engine.scheduler.prefill_chunks
    wall_s, records = serve(llm, requests)
    assert all(r["seq"].finish_reason == "length" for r in records), "a request did not complete"
    result = {
        "bench": "engine_throughput",
        "machine": machine_name(engine.backend),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "flashnext_version": version("flashnext"),
        "backend": llm.info.backend,
        "model": loaded.name,
        "precision": engine.precision.name,
        "profile": llm.profile.model_dump(),
        "num_requests": args.num_requests,
        "prompt_len": list(args.prompt_len),
        "output_len": list(args.output_len),
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "seed": args.seed,
        "preemptions": engine.scheduler.preemptions - preempt0,
        "prefill_chunks": engine.scheduler.prefill_chunks - chunks0,
        "kv_blocks": engine.blocks.num_blocks,
    } | summarize(wall_s, records)
    print_table(result)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return result


def print_table(r: dict):
    title = (
        f"{r['backend']} · {r['model']} · {r['precision']} · profile {r['profile']['name']} · "
        f"{r['num_requests']} requests · {r['wall_s']:.1f} s"
    )
    table = Table("metric", "value", title=title)
    table.add_row("output tok/s", f"{r['output_tok_s']:.1f}")
    table.add_row("total tok/s (prompt + output)", f"{r['total_tok_s']:.1f}")
    table.add_row("requests/s", f"{r['requests_per_s']:.3f}")
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "inter-token latency"), ("e2e_s", "end-to-end latency")):
        p = r[key]
        table.add_row(
            f"{label} p50 / p90 / p99 (ms)",
            " / ".join("-" if p[q] is None else f"{1000 * p[q]:.1f}" for q in ("p50", "p90", "p99")),
        )
    table.add_row("preemptions · prefill chunks", f"{r['preemptions']} · {r['prefill_chunks']}")
    Console().print(table)


if __name__ == "__main__":
    main()
