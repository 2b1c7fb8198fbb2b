"""What batch-invariant numerics (profile `batch_invariant`) cost: decode tok/s at each batch size and prefill tok/s,
on and off, in interleaved rounds (on a shared machine a slow spell then hits both modes alike); medians.

    python benchmarks/bench_batch_invariance.py --backend cpu --batch-sizes 1,8 --json cpu.json   # embedded model
    python benchmarks/bench_batch_invariance.py --backend cuda --shape qwen3-0.6b --batch-sizes 1,64 --json cuda.json

Every prompt is distinct random tokens (no prefix-cache help), every request generates --gen-len tokens (EOS
ignored). Prefill is one --prompt-len prompt alone, timed to its first token. The load average is recorded each
round. On the CPU both engines stay loaded and alternate; on an accelerator each round builds one engine at a time
(two would not fit beside each other's KV caches).
"""

import argparse
import gc
import json
import os
import statistics
import time
from importlib.metadata import version

import torch
from rich.console import Console
from rich.table import Table

from flashnext.core.cli_bench import load_bench_model, machine_name, parse_batch_sizes, time_generation
from flashnext.core.llm import LLM

MODES = {"off": False, "on": True}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cpu")
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    p.add_argument("--shape", default=None, help="random weights of a known shape instead, e.g. qwen3-0.6b")
    p.add_argument("--precision", default=None)
    p.add_argument("--batch-sizes", default="1,8", type=parse_batch_sizes)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-cache-max-gib", type=float, default=None)
    p.add_argument("--json", dest="json_path", default=None)
    return p.parse_args(argv)


def build(args, loaded, invariant: bool) -> LLM:
    overrides = {"batch_invariant": invariant, "max_num_seqs": max(args.batch_sizes)}
    if args.kv_cache_max_gib:
        overrides["kv_cache_max_gib"] = args.kv_cache_max_gib
    llm = LLM(model=loaded, backend=args.backend, precision=args.precision, **overrides)
    llm.warm_up()
    for b in args.batch_sizes:  # graphs, compiles and weight expansion outside the timed rounds
        time_generation(llm, b, args.prompt_len, 4, seed=10_000 + b)
    return llm


def measure(args, llm: LLM, round_index: int) -> dict:
    row = {"load_avg_1m": round(os.getloadavg()[0], 2)}
    for b in args.batch_sizes:
        t = time_generation(llm, b, args.prompt_len, args.gen_len, seed=round_index * 1000 + b)
        row[f"decode_tok_s_b{b}"] = t.decode_tok_s
    t = time_generation(llm, 1, args.prompt_len, 1, seed=round_index * 1000 + 999)
    row["prefill_tok_s"] = args.prompt_len / t.ttft_s
    llm.engine.backend.synchronize()
    return row


def run(args) -> dict:
    loaded = load_bench_model(args.model, args.shape)
    shared_host = args.backend == "cpu"
    engines = {mode: build(args, loaded, flag) for mode, flag in MODES.items()} if shared_host else {}
    rounds: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
        for mode in order:
            llm = engines[mode] if shared_host else build(args, loaded, MODES[mode])
            rounds[mode].append(measure(args, llm, r))
            if not shared_host:
                del llm
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    keys = [k for k in rounds["off"][0] if k != "load_avg_1m"]
    medians = {mode: {k: statistics.median(x[k] for x in rows) for k in keys} for mode, rows in rounds.items()}
    cost = {k: 1 - medians["on"][k] / medians["off"][k] for k in keys}
    # Each round's on and off ran back to back: their ratio cancels most of a drifting load.
    paired = {k: statistics.median(1 - on[k] / off[k] for on, off in zip(rounds["on"], rounds["off"])) for k in keys}
    any_llm = next(iter(engines.values()), None)
    return {
        "bench": "batch_invariance",
        "machine": machine_name(any_llm.engine.backend) if any_llm else args.backend,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "flashnext_version": version("flashnext"),
        "backend": args.backend,
        "model": loaded.name,
        "precision": any_llm.engine.precision.name if any_llm else args.precision,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "batch_sizes": args.batch_sizes,
        "rounds": rounds,
        "median": medians,
        "cost": cost,  # fraction of off's speed lost with batch_invariant on (negative: faster), of the medians
        "cost_paired": paired,  # the median over rounds of each round's own cost
    }


def print_table(result: dict) -> None:
    table = Table(title=f"batch_invariant · {result['backend']} · {result['model']} · {result['precision']}")
    for col in ("metric", "off (median)", "on (median)", "cost", "cost (paired rounds)"):
        table.add_column(col, justify="right" if col != "metric" else "left")
    for key, cost in result["cost"].items():
        off, on = result["median"]["off"][key], result["median"]["on"][key]
        paired = result["cost_paired"][key]
        table.add_row(key, f"{off:.1f}", f"{on:.1f}", f"{cost * 100:+.1f}%", f"{paired * 100:+.1f}%")
    loads = [r["load_avg_1m"] for rows in result["rounds"].values() for r in rows]
    Console().print(table)
    print(f"{len(result['rounds']['on'])} interleaved rounds; 1-min load average {min(loads):.2f}-{max(loads):.2f}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    print_table(result)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return result


if __name__ == "__main__":
    main()
