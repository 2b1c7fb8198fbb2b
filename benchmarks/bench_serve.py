"""Serving over HTTP: `flashnext serve` driven by the official `openai` client, N streamed requests at concurrency C.

Reports, as the client sees them: request/s, output tok/s, TTFT and inter-token latency percentiles (p50/p90/p99).
Prompts are distinct random token ids (the prefix cache never helps, tokenization is not timed) and every request
generates its drawn output length (EOS ignored), so a run is repeatable for a given --seed. Compare with
benchmarks/bench_engine.py on the same shape for the cost of the HTTP layer.

    python benchmarks/bench_serve.py --backend cpu --num-requests 64 --concurrency 16 --json out.json
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000      # a server that is already running
    python benchmarks/bench_serve.py --backend cpu --soak --json soak.json  # resident memory, round by round

`--soak` starts its own server and sends rounds of --round-size mixed requests (completions and chat, streamed and
not, stop strings, one client in ten hanging up mid-stream), reading the server's resident memory after each round.
The KV cache is allocated up front but its pages become resident only when a block is first written, and the
free list hands blocks out oldest-first (prefix-cache eviction order), so the first rounds touch more and more of it:
warm-up lasts until the rounds have cycled through every KV block once, plus one round. After warm-up, resident
memory must grow by at most --max-growth over --rounds rounds (exit 1 otherwise).
"""

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from importlib.metadata import version

import httpx
import numpy as np
import openai
import torch
from rich.console import Console
from rich.table import Table

from flashnext.core import registry
from flashnext.core.cli_bench import machine_name


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server; otherwise one is started with the flags below")
    p.add_argument("--backend", default="auto")
    p.add_argument("--model", help="default: the embedded SmolLM2-135M")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", default="32,512", help="MIN,MAX prompt tokens (uniform)")
    p.add_argument("--gen-len", default="16,128", help="MIN,MAX generated tokens (uniform)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path")
    p.add_argument("--soak", action="store_true", help="resident memory per round of requests (see above)")
    p.add_argument("--round-size", type=int, default=200, help="--soak: requests a round")
    p.add_argument("--rounds", type=int, default=10, help="--soak: rounds measured after warm-up")
    p.add_argument("--max-growth", type=float, default=0.05, help="--soak: allowed growth after warm-up")
    return p.parse_args(argv)


def _span(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


def start_server(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-c",
        "from flashnext.core.cli import main; main()",
        "serve",
        "--port",
        str(port),
        "--backend",
        args.backend,
        "--log-level",
        "warning",
    ]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else []
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health").json()["status"] == "ok":
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become healthy")


async def one_request(client, model: str, prompt: list[int], gen_len: int) -> dict:
    start = time.perf_counter()
    stamps, tokens = [], 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=gen_len,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    gaps = np.diff(stamps).tolist()
    return {"ttft": stamps[0] - start, "gaps": gaps, "tokens": tokens, "latency": time.perf_counter() - start}


async def drive(url: str, args) -> tuple[list[dict], float, str]:
    rng = random.Random(args.seed)
    (p_lo, p_hi), (g_lo, g_hi) = _span(args.prompt_len), _span(args.gen_len)
    # Ids below 256 exist in every byte-level vocabulary, so any served model takes these prompts.
    jobs = [
        ([rng.randrange(256) for _ in range(rng.randint(p_lo, p_hi))], rng.randint(g_lo, g_hi))
        for _ in range(args.num_requests)
    ]
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key=os.environ.get("FLASHNEXT_API_KEY", "none"), max_retries=0, timeout=3600
    )
    model = (await client.models.list()).data[0].id
    gate = asyncio.Semaphore(args.concurrency)

    async def limited(job):
        async with gate:
            return await one_request(client, model, *job)

    start = time.perf_counter()
    results = await asyncio.gather(*(limited(job) for job in jobs))
    elapsed = time.perf_counter() - start
    await client.close()
    return results, elapsed, model


def summarize(results: list[dict], elapsed: float) -> dict:
    ttft = np.array([r["ttft"] for r in results])
    gaps = np.array([g for r in results for g in r["gaps"]] or [0.0])
    tokens = sum(r["tokens"] for r in results)
    pct = lambda a: {f"p{q}": round(float(np.percentile(a, q)) * 1000, 2) for q in (50, 90, 99)}  # noqa: E731
    return {
        "duration_s": round(elapsed, 3),
        "requests_per_s": round(len(results) / elapsed, 3),
        "output_tok_s": round(tokens / elapsed, 2),
        "output_tokens": tokens,
        "ttft_ms": pct(ttft),
        "itl_ms": pct(gaps),
    }


def resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


async def soak_request(client, model: str, rng: random.Random, i: int) -> int:
    """One mixed request; returns the KV blocks' worth of tokens it asked for (prompt + output)."""
    gen = rng.randint(1, 4)
    hangup, stream = i % 10 == 9, i % 3 != 0
    if i % 2:
        prompt = [rng.randrange(256) for _ in range(rng.randint(8, 64))]
        call = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=gen,
            temperature=0.7,
            seed=i,
            stop=["\n\n"],
            stream=stream or hangup,
            extra_body={"ignore_eos": True},
        )
        size = len(prompt)
    else:
        text = f"Request {i}: " + " ".join(str(rng.randrange(10**6)) for _ in range(rng.randint(2, 24)))
        call = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            max_tokens=gen,
            temperature=0,
            stream=stream or hangup,
        )
        size = 30 + len(text) // 2  # the template's tokens plus about one token per two characters
    reply = await call
    if stream or hangup:
        async for _ in reply:
            if hangup:
                break
        await reply.close()
    return size + gen


async def soak_round(url: str, args, round_index: int, concurrency: int) -> int:
    rng = random.Random(args.seed * 1_000_003 + round_index)
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key=os.environ.get("FLASHNEXT_API_KEY", "none"), max_retries=0, timeout=600
    )
    model = (await client.models.list()).data[0].id
    gate = asyncio.Semaphore(concurrency)

    async def limited(i):
        async with gate:
            return await soak_request(client, model, rng, round_index * args.round_size + i)

    sizes = await asyncio.gather(*(limited(i) for i in range(args.round_size)))
    await client.close()
    return sum(sizes)


def soak(args, proc: subprocess.Popen, url: str) -> dict:
    health = httpx.get(f"{url}/health").json()
    blocks, block_size = health["kv_cache"]["blocks_total"], health["kv_cache"]["block_size"]
    rows, tokens, warm_rounds = [], 0, None
    start_mib = resident_mib(proc.pid)
    table = Table(
        "round",
        "phase",
        "s",
        "KV cycled",
        "RSS MiB",
        "vs first measured",
        title=f"flashnext serve soak: {args.round_size} requests a round",
    )
    console = Console()
    round_index = 0
    while warm_rounds is None or round_index < warm_rounds + args.rounds:
        t0 = time.perf_counter()
        tokens += asyncio.run(soak_round(url, args, round_index, args.concurrency))
        cycled = tokens / (blocks * block_size)
        rss = resident_mib(proc.pid)
        if warm_rounds is None and cycled >= 1.0:
            warm_rounds = round_index + 2  # every block touched once, then one more round
        phase = "warm-up" if warm_rounds is None or round_index < warm_rounds else "measured"
        rows.append(
            {
                "round": round_index,
                "phase": phase,
                "seconds": round(time.perf_counter() - t0, 2),
                "kv_cycled": round(cycled, 3),
                "rss_mib": round(rss, 1),
            }
        )
        round_index += 1
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    measured = [r for r in rows if r["phase"] == "measured"]
    first = measured[0]["rss_mib"]
    for r in rows:
        growth = f"{(r['rss_mib'] / first - 1) * 100:+.1f}%" if r["phase"] == "measured" else ""
        table.add_row(
            str(r["round"]), r["phase"], str(r["seconds"]), f"{r['kv_cycled']:.0%}", f"{r['rss_mib']:.0f}", growth
        )
    console.print(table)
    growth = measured[-1]["rss_mib"] / first - 1
    peak_growth = max(r["rss_mib"] for r in measured) / first - 1
    final = httpx.get(f"{url}/health").json()
    return {
        "start_rss_mib": round(start_mib, 1),
        "rounds": rows,
        "kv_blocks": blocks,
        "block_size": block_size,
        "growth_after_warm_up": round(growth, 4),
        "peak_growth_after_warm_up": round(peak_growth, 4),
        "max_growth": args.max_growth,
        "passed": growth <= args.max_growth and peak_growth <= args.max_growth,
        "blocks_free_at_end": final["kv_cache"]["blocks_free"],
        "health": final,
    }


def main(argv=None):
    args = parse_args(argv)
    if args.soak:
        return main_soak(args)
    proc, url = (None, args.url) if args.url else start_server(args)
    try:
        health = httpx.get(f"{url}/health").json()
        results, elapsed, model = asyncio.run(drive(url, args))
    finally:
        if proc:
            proc.terminate()
            proc.wait(30)
    row = {
        "machine": machine_name(registry.select(registry.discover(), health["backend"]).backend),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "backend": health["backend"],
        "model": model,
        "precision": health["precision"],
        "profile": health["profile"],
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        **summarize(results, elapsed),
        "flashnext": version("flashnext"),
    }
    table = Table(
        "backend",
        "model",
        "reqs",
        "conc",
        "req/s",
        "out tok/s",
        "TTFT p50/p90/p99 ms",
        "ITL p50/p90/p99 ms",
        title=f"flashnext serve over HTTP ({row['machine']})",
    )
    table.add_row(
        row["backend"],
        model,
        str(args.num_requests),
        str(args.concurrency),
        f"{row['requests_per_s']}",
        f"{row['output_tok_s']}",
        "/".join(str(v) for v in row["ttft_ms"].values()),
        "/".join(str(v) for v in row["itl_ms"].values()),
    )
    Console().print(table)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump([row], f, indent=2)


def main_soak(args):
    if args.url:
        raise SystemExit("--soak starts its own server (it reads that process's resident memory); drop --url")
    proc, url = start_server(args)
    try:
        result = soak(args, proc, url)
    finally:
        proc.terminate()
        proc.wait(30)
    result = {
        "machine": machine_name(torch.device("cpu" if args.backend == "cpu" else "cuda")),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "backend": result["health"]["backend"],
        "model": result["health"]["model"],
        "round_size": args.round_size,
        "concurrency": args.concurrency,
        "env": {k: v for k, v in os.environ.items() if k.startswith("FLASHNEXT_") and k != "FLASHNEXT_API_KEY"},
        **result,
        "flashnext": version("flashnext"),
    }
    print(
        f"growth after warm-up: {result['growth_after_warm_up']:+.1%} (peak {result['peak_growth_after_warm_up']:+.1%},"
        f" allowed {args.max_growth:.0%}); blocks free at the end: {result['blocks_free_at_end']}/{result['kv_blocks']}"
    )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    if not result["passed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
