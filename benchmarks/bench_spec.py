"""Batch-1 decode speed with speculative decoding (ngram / mtp) against none, with acceptance numbers beside.

Two prompt kinds: copy-heavy (repeat / correct / edit a given text: the output re-uses the prompt, so n-gram drafts
hit) and free-form (the output is new text: drafts rarely hit, and adaptive mode must not cost more than 5%).
Every method decodes the same greedy tokens (speculative decoding is lossless), so tok/s compare like for like.

    python benchmarks/bench_spec.py --backend cpu --gen-len 64 --json spec_cpu.json       # the embedded SmolLM2
    python benchmarks/bench_spec.py --backend cuda --model Qwen/Qwen3-0.6B --json spec_h200.json
    python benchmarks/bench_spec.py --backend cuda --shape qwen3-0.6b                     # random weights: timing only

With --shape the weights are random and the prompts are token ids (a random passage repeated for copy-heavy),
so the acceptance numbers say what the random model happened to repeat, not what a real model would.

Each method runs in a process of its own: on an H200 the second engine built in one process decoded ~10% slower
than the first whichever method it ran, which made "x none" depend on the order (--in-process: one process).
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib.metadata import version

import torch
from rich.console import Console
from rich.table import Table

from flashnext.core.cli_bench import SHAPES, load_bench_model, machine_name
from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.llm import LLM

PASSAGE = (
    "The harbour town woke slowly. Fishermen pulled their boats up the shingle, the baker opened his shutters, and "
    "the ferry to the island sounded its horn twice before leaving at seven. By nine the market square was full: "
    "crates of apples, bolts of blue cloth, a man selling brass compasses that never quite pointed north. "
    "Children ran between the stalls while their parents argued about the price of eggs."
)
CODE = (
    "def total_price(items, tax):\n"
    "    x = 0\n"
    "    for item in items:\n"
    "        x += item.price * item.quantity\n"
    "    x = x * (1 + tax)\n"
    "    return round(x, 2)\n"
)
COPY_HEAVY = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    "Correct the spelling mistakes in this text and print the whole corrected text:\n\n"
    + PASSAGE.replace("slowly", "slowley").replace("opened", "opend").replace("market", "markett"),
    f"Rename the variable x to subtotal in this Python function and print the whole function:\n\n{CODE}",
]
FREE_FORM = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how photosynthesis works to a ten-year-old.",
    "Give five ideas for a rainy-day activity and say why each one is fun.",
]
KINDS = {"copy-heavy": COPY_HEAVY, "free-form": FREE_FORM}
# Method name -> profile overrides.
METHODS = {
    "none": {"spec": "none"},
    "ngram": {"spec": "ngram", "spec_adaptive": True},
    "ngram-fixed": {"spec": "ngram", "spec_adaptive": False},
    "mtp": {"spec": "mtp", "spec_adaptive": True},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto")
    p.add_argument("--model", help="model path or HF id (default: the embedded SmolLM2-135M)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="random weights of this model's shape instead of --model")
    p.add_argument("--precision")
    p.add_argument("--profile")
    p.add_argument("--methods", default="none,ngram,ngram-fixed", help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--spec-tokens", type=int, default=4)
    p.add_argument(
        "--kinds",
        default="copy-heavy,free-form",
        help="prompt kinds in the order they run (what ran before a request is what the chooser knows)",
    )
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="times each prompt is timed (the best run counts)")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="decode --gen-len tokens past the end of the answer (default: stop where the model ends its "
        "turn, as a user's request does; past it a chat model writes new text, not a copy)",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads (1 is steadier on a shared VM)")
    p.add_argument("--json", dest="json_path", help="write the result list here")
    p.add_argument("--in-process", action="store_true", help="every method in this process, one after another")
    p.add_argument("--rows-to", help=argparse.SUPPRESS)  # a child process: its rows, outputs kept, to this file
    args = p.parse_args(argv)
    if args.model and args.shape:
        p.error("give --model or --shape, not both")
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        p.error(f"unknown method(s) {', '.join(sorted(unknown))}: choose from {', '.join(METHODS)}")
    if sorted(args.kinds.split(",")) != sorted(KINDS):
        p.error(f"--kinds {args.kinds}: name each of {', '.join(KINDS)} once, in the order they should run")
    return args


def prompt_sets(llm: LLM, random_weights: bool, kinds: list[str]) -> dict[str, list[list[int]]]:
    if not random_weights:
        return {
            kind: [llm.encode(p, chat=llm.tokenizer.chat_template is not None) for p in KINDS[kind]] for kind in kinds
        }
    rng, vocab = random.Random(0), llm.engine.config.vocab_size
    passages = [[rng.randrange(vocab) for _ in range(96)] for _ in range(3)]
    token_sets = {"copy-heavy": [p + p[:8] for p in passages], "free-form": [p[:104] for p in passages[::-1]]}
    return {kind: token_sets[kind] for kind in kinds}


def decode_run(llm: LLM, prompt: list[int], gen_len: int, ignore_eos: bool) -> tuple[float, int, list[int]]:
    """(decode seconds after the first token, decoded tokens after the first, output ids) for one request."""
    engine = llm.engine
    seq = engine.add_request(prompt, SamplingParams(max_tokens=gen_len, ignore_eos=ignore_eos))
    first = None
    while seq.finish_reason is None:
        engine.step()
        if first is None and seq.output_ids:
            first = time.perf_counter()
    return time.perf_counter() - first, len(seq.output_ids) - 1, seq.output_ids


def bench_method(args, loaded, method: str) -> list[dict]:
    # No prefix cache: a repeat would prefill only the uncached tail of its prompt, which rounds differently in
    # 16 bits and so decodes other tokens; without it every run of a prompt decodes the same tokens, and the
    # fastest run of each method times the same text.
    llm = LLM(
        model=loaded,
        backend=args.backend,
        precision=args.precision,
        profile=args.profile,
        spec_tokens=args.spec_tokens,
        prefix_caching=False,
        **METHODS[method],
    )
    prompts = prompt_sets(llm, random_weights=bool(args.shape), kinds=args.kinds.split(","))
    common = {
        "machine": machine_name(llm.engine.backend),
        "backend": llm.info.backend,
        "model": args.shape or llm.info.model,
        "precision": llm.engine.precision.name,
        "spec_tokens": args.spec_tokens,
        "gen_len": args.gen_len,
        "ignore_eos": args.ignore_eos,
        "batch_size": 1,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "flashnext": version("flashnext"),
    }
    decode_run(llm, next(iter(prompts.values()))[0], 8, True)  # warm-up
    rows = []
    for kind, kind_prompts in prompts.items():
        before = llm.engine.spec_stats()
        seconds, tokens, outputs, per_prompt = 0.0, 0, [], []
        for prompt in kind_prompts:
            runs = [decode_run(llm, prompt, args.gen_len, args.ignore_eos) for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r[0] / max(r[1], 1))
            seconds, tokens = seconds + best[0], tokens + best[1]
            per_prompt.append(
                {
                    "decode_s": round(best[0], 5),
                    "tokens": best[1],
                    "same_tokens_every_run": all(r[2] == runs[0][2] for r in runs),
                }
            )
            outputs.append(runs[0][2])
        after = llm.engine.spec_stats()
        drafted, accepted = after["drafted"] - before["drafted"], after["accepted"] - before["accepted"]
        drafts = after["drafts"] - before["drafts"]
        per_position = [
            a - b
            for a, b in zip(
                after["accepted_per_position"],
                before["accepted_per_position"] + [0] * len(after["accepted_per_position"]),
            )
        ]
        rows.append(
            common
            | {
                "method": method,
                "prompts": kind,
                "decode_tok_s": round(tokens / seconds, 2),
                "drafts": drafts,
                "drafted": drafted,
                "accepted": accepted,
                "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
                "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 0.0,
                # Share of verify steps whose draft at position i was accepted (vLLM's per-position acceptance).
                "acceptance_per_position": [round(n / drafts, 4) for n in per_position] if drafts else [],
                "per_prompt": per_prompt,
                "outputs": outputs,
            }
        )
    return rows


def child_argv(args) -> list[str]:
    """The options a child process needs to bench one method as this run would."""
    argv = [
        "--backend",
        args.backend,
        "--spec-tokens",
        str(args.spec_tokens),
        "--gen-len",
        str(args.gen_len),
        "--repeats",
        str(args.repeats),
        "--kinds",
        args.kinds,
    ] + (["--ignore-eos"] if args.ignore_eos else [])
    for name in ("model", "shape", "precision", "profile", "threads"):
        if getattr(args, name) is not None:
            argv += [f"--{name}", str(getattr(args, name))]
    return argv


def rows_in_child(args, method: str) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run(
            [sys.executable, __file__, *child_argv(args), "--methods", method, "--rows-to", f.name], check=True
        )
        return json.load(f)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    if args.in_process or args.rows_to:
        loaded = load_bench_model(args.model, args.shape)
        rows = [row for method in methods for row in bench_method(args, loaded, method)]
        if args.rows_to:
            with open(args.rows_to, "w") as f:
                json.dump(rows, f)
            return
    else:
        rows = [row for method in methods for row in rows_in_child(args, method)]
    baseline = {r["prompts"]: r for r in rows if r["method"] == "none"}
    for r in rows:
        base = baseline.get(r["prompts"])
        r["speedup_vs_none"] = round(r["decode_tok_s"] / base["decode_tok_s"], 3) if base else None
        # Speculative decoding is lossless: the same greedy tokens as none, or the run is wrong.
        r["same_output_as_none"] = r["outputs"] == base["outputs"] if base else None
        if base and not r["same_output_as_none"]:  # where each prompt's tokens part (None: identical)
            r["first_difference"] = [
                next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                for a, b in zip(r["outputs"], base["outputs"])
            ]
    table = Table(title=f"speculative decoding, batch 1 · {rows[0]['machine']} · {rows[0]['model']}")
    for col in (
        "prompts",
        "method",
        "decode tok/s",
        "× none",
        "verify steps",
        "accept rate",
        "mean accept len",
        "lossless",
    ):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["prompts"],
            r["method"],
            f"{r['decode_tok_s']:.1f}",
            f"{r['speedup_vs_none'] or 0:.2f}",
            str(r["drafts"]),
            f"{r['acceptance_rate']:.2f}",
            f"{r['mean_acceptance_length']:.2f}",
            str(r["same_output_as_none"]),
        )
    Console(width=150).print(table)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
