"""Decode speed of the default model with 1 thread, all threads and the auto choice, quiet and with a core busy.

The busy core is a `python -c "while True: pass"` this script starts and stops. One engine serves every
measurement (torch's thread count changes between them); each is the median of --repeats greedy generations.

    python benchmarks/bench_threads.py --gen-len 64 --repeats 3 --json threads.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import psutil
import torch

from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.llm import LLM
from flashnext.core.threads import busy_cores_of_others, choose_threads

PROMPT = "Write a haiku about rain"


def decode_tok_s(llm: LLM, gen_len: int) -> float:
    params = SamplingParams(max_tokens=gen_len, ignore_eos=True)
    first = end = None
    count = 0
    for _, ids in llm.stream(PROMPT, params, chat=True):
        if ids:
            count += len(ids)
            first = first or time.perf_counter()
    end = time.perf_counter()
    return (count - 1) / (end - first)


def measure(llm: LLM, condition: str, gen_len: int, repeats: int) -> list[dict]:
    busy = busy_cores_of_others(0.5)
    auto = choose_threads(None, busy).threads
    rows = []
    for label, threads in (
        ("1", 1),
        (str(psutil.cpu_count(logical=False)), psutil.cpu_count(logical=False)),
        (f"auto ({auto})", auto),
    ):
        torch.set_num_threads(threads)
        decode_tok_s(llm, 4)  # settle the new team
        rates = [decode_tok_s(llm, gen_len) for _ in range(repeats)]
        rows.append(
            {
                "condition": condition,
                "threads": label,
                "decode_tok_s": round(statistics.median(rates), 1),
                "runs": [round(r, 1) for r in rates],
                "busy_cores_of_others": round(busy, 2),
                "loadavg_1m": round(os.getloadavg()[0], 2),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(argv)
    llm = LLM(backend="cpu", threads=psutil.cpu_count(logical=False))
    decode_tok_s(llm, 8)  # expand the int4 weights once
    rows = measure(llm, "as found", args.gen_len, args.repeats)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        rows += measure(llm, "one core kept busy", args.gen_len, args.repeats)
    finally:
        hog.kill()
        hog.wait()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
