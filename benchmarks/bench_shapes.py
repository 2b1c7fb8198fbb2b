"""Small-batch decode across model sizes: where 8-bit and 4-bit weights pay.

A decode step of a small model is bound by the latency of its ~200 kernels, a large one's by the bytes of its
weights; quantized weights speed up only the second. Random weights of each shape (the Qwen3 family's, and
SmolLM2-135M's), one engine per (shape, precision), `bench_rows` at each batch size (default 1 and 4); decode
tok/s, TTFT and peak memory, with each precision's decode rate over the first precision's at the same batch size.
The random bf16 weights are built once on the device and stay there for every precision, so an int4 or fp8
engine's peak memory includes them (`flashnext bench --shape` builds them on the CPU and reports the engine's own).

    python benchmarks/bench_shapes.py --backend cuda --json out.json
    python benchmarks/bench_shapes.py --backend cuda --shapes qwen3-8b --precisions bf16,int4
"""

import argparse
import json
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from flashnext.core import registry
from flashnext.core.cli_bench import SHAPES, bench_rows, parse_batch_sizes, random_model_of
from flashnext.core.errors import UserError
from flashnext.core.precision import PRECISIONS

# The Qwen3 dense sizes past 0.6B (head_dim 128, 8 KV heads, vocabulary 151,936 as 0.6B's; 8B unties the head).
LARGER = {
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, tie_word_embeddings=False),
}
CONFIGS = SHAPES | {name: SHAPES["qwen3-0.6b"].model_copy(update=update) for name, update in LARGER.items()}


def names(text: str, known) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in items if x not in known]
    if not items or unknown:
        raise argparse.ArgumentTypeError(f"'{text}': choose from {', '.join(known)}")
    return items


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto")
    p.add_argument("--shapes", type=lambda t: names(t, CONFIGS), default=["qwen3-0.6b", *LARGER])
    p.add_argument(
        "--precisions",
        type=lambda t: names(t, PRECISIONS),
        default=["bf16", "fp8-e4m3", "int4"],
        help="the first is the others' baseline",
    )
    p.add_argument("--batch-sizes", default="1,4", help="comma-separated, e.g. 1,4")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", dest="json_path", help="write the result object here")
    return p.parse_args(argv)


def shape_rows(shape: str, args, device: torch.device) -> list[dict]:
    loaded = random_model_of(CONFIGS[shape], shape, device)
    cfg = loaded.config
    params = sum(w.numel() for w in loaded.weights.values())
    rows = []
    for precision in args.precisions:
        for row in bench_rows(loaded, args.backend, precision, None, args.batch_sizes, args.prompt_len, args.gen_len):
            rows.append(
                row
                | {"params": params, "layers": cfg.num_layers, "hidden": cfg.hidden_size, "ffn": cfg.intermediate_size}
            )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = {r["batch_size"]: r["decode_tok_s"] for r in rows if r["precision"] == rows[0]["precision"]}
    for row in rows:
        row[f"decode_over_{args.precisions[0]}"] = round(row["decode_tok_s"] / base[row["batch_size"]], 3)
    return rows


def main(argv=None):
    args = parse_args(argv)
    args.batch_sizes = parse_batch_sizes(args.batch_sizes)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = registry.select(registry.discover(), args.backend).backend.device()
    rows = []
    for shape in args.shapes:
        rows += shape_rows(shape, args, device)
    table = Table(
        title=f"decode, {args.prompt_len} in / {args.gen_len} out a request, random weights",
        caption="peak MiB counts the random bf16 weights too, which every precision's engine is built from",
    )
    ratio = f"decode_over_{args.precisions[0]}"
    for col in (
        "shape",
        "params (B)",
        "precision",
        "batch",
        "decode tok/s",
        f"/ {args.precisions[0]}",
        "TTFT ms",
        "peak MiB",
    ):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["shape"].removeprefix("random:"),
            f"{r['params'] / 1e9:.2f}",
            r["precision"],
            str(r["batch_size"]),
            f"{r['decode_tok_s']:,.1f}",
            f"{r[ratio]:.2f}x",
            f"{r['ttft_s'] * 1e3:.1f}",
            f"{r['peak_memory_bytes'] / 2**20:,.0f}",
        )
    Console().print(table)
    if args.json_path:
        result = {
            "bench": "decode_by_shape",
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": rows[0]["machine"],
            "prompt_len": args.prompt_len,
            "gen_len": args.gen_len,
            "rows": rows,
        }
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:  # e.g. a backend this machine lacks, a precision it cannot run
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
