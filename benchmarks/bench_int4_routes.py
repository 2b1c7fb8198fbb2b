"""One int4 projection call per route at decode batch sizes: where each route pays, against the bf16 weight.

For each projection of the Qwen3 shapes (qkv, o, gate/up, down), random weights quantized to int4 (groups of 128
columns, or --group), microseconds a call inside a CUDA graph, the graph cycling through copies of the weight that
together exceed L2 (so weights stream from HBM, as in a decode step): the route `CudaKernels.linear` takes now,
the same call with the wide route (large weights widened as the skinny GEMM's first operand) switched off, and the
bf16 weight. NMSE is against the float64 product with the bf16-rounded dequantized weight.

    python benchmarks/bench_int4_routes.py --json out.json
    python benchmarks/bench_int4_routes.py --shapes qwen3-8b --rows 24,64 --group 32
"""

import argparse
import json
import sys
import time
from unittest import mock

import torch
from bench_cuda import rotating_time_us
from bench_shapes import CONFIGS, names

from flashnext.core.precision import Int4Weight, int4_quantize
from flashnext.plugins.cuda.kernels import CudaKernels

L2_PAST_BYTES = 150e6  # an H200 has 50 MB of L2


def projections(cfg) -> dict[str, tuple[int, int]]:
    q = cfg.num_heads * cfg.head_dim
    return {
        "qkv": (q + 2 * cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size),
        "o": (cfg.hidden_size, q),
        "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
        "down": (cfg.hidden_size, cfg.intermediate_size),
    }


def route(kernels: CudaKernels, x, w: Int4Weight) -> str:
    if kernels._gemv_route(x, w):
        return "gemv"
    if kernels._wide_int4(x, w):
        return "wide"
    if kernels._takes_int8_rows(x, w):
        return "int8 rows"
    return "widened" if kernels._skinny_fits(x, w) else "pass + bf16"


def us_a_call(call, copies: int) -> float:
    """µs a call, call(i) taking copy i of the weight in turn (bench_cuda's graph timing)."""
    return rotating_time_us(call, copies, iters=max(112, copies))


def measure(kernels: CudaKernels, shape: str, proj: str, n: int, k: int, rows_list: list[int], group: int) -> list:
    w = int4_quantize(torch.randn(n, k, device="cuda") * 0.02, group_size=group)
    copies = max(2, int(L2_PAST_BYTES // (n * k // 2)) + 1)
    int4s = [w] + [Int4Weight(w.packed.clone(), w.scales.clone(), w.offsets.clone(), group) for _ in range(copies - 1)]
    dense = w.dequantize(torch.bfloat16)
    bf16_copies = max(2, int(L2_PAST_BYTES // (n * k * 2)) + 1)
    bf16s = [dense] + [dense.clone() for _ in range(bf16_copies - 1)]
    out = []
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        want = x.double() @ dense.double().T
        got = kernels.linear(x, w).double()
        row = dict(
            shape=shape,
            proj=proj,
            n=n,
            k=k,
            rows=rows,
            group=group,
            route=route(kernels, x, w),
            nmse=float(((got - want) ** 2).mean() / (want**2).mean()),
        )
        row["int4_us"] = us_a_call(lambda i: kernels.linear(x, int4s[i]), copies)
        with mock.patch.object(CudaKernels, "_wide_int4", lambda self, x, w: False):
            row["route_without_wide"] = route(kernels, x, w)
            row["int4_without_wide_us"] = us_a_call(lambda i: kernels.linear(x, int4s[i]), copies)
        row["bf16_us"] = us_a_call(lambda i: kernels.linear(x, bf16s[i]), bf16_copies)
        out.append(row)
        print(
            f"{shape:11} {proj:8} {rows:3}  {row['route']:11} {row['int4_us']:7.2f}   "
            f"{row['route_without_wide']:11} {row['int4_without_wide_us']:7.2f}   bf16 {row['bf16_us']:7.2f}"
            f"   nmse {row['nmse']:.1e}",
            flush=True,
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--shapes", type=lambda t: names(t, CONFIGS), default=["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b"]
    )
    p.add_argument("--rows", default="8,24,32,64", help="comma-separated row counts (decode batch sizes)")
    p.add_argument("--group", type=int, default=128, help="int4 columns a scale (GGUF's Q4 blocks: 32)")
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_int4_routes: needs a CUDA GPU (the routes are the CUDA backend's)", file=sys.stderr)
        return 2
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    kernels = CudaKernels()
    print(f"{'shape':11} {'proj':8} {'rows':>3}  {'route':11} {'us':>7}   {'without wide':11} {'us':>7}")
    results = []
    for shape in args.shapes:
        for proj, (n, k) in projections(CONFIGS[shape]).items():
            results += measure(kernels, shape, proj, n, k, rows_list, args.group)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(
                {
                    "bench": "int4_routes",
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "device": torch.cuda.get_device_name(),
                    "rows": results,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
