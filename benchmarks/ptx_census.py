"""What the one-row GEMV compiles to on an H100 / H200 (sm_90), on any machine: PTX instructions a thread, shuffles,
barriers, dp4a and the widths of its global loads, for a weight kind and shape.

Triton compiles for a GPU it does not have; what it learns at launch (pointers 16-byte aligned, integer arguments
that divide by 16, an argument equal to 1) is given here as the launcher would give it, and the program shape is the
backend's own (gemv_config, gemv_k_pieces). Counts are static (the kernel has no loops) and depend on the Triton
version: compare rows from one machine.

    python benchmarks/ptx_census.py --kind int4 --shape 6144x2560          # Qwen3-4B's qkv projection
    python benchmarks/ptx_census.py --kind int4 --shape 9728x2560 --silu --json out.json
"""

import argparse
import json
import os
import re
import sys
from collections import Counter

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter's functions do not compile

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashnext.plugins.cuda import gemv, launch  # noqa: E402

KINDS = {
    "bf16": (launch.DENSE, "*bf16", "*bf16"),
    "fp8": (launch.FP8, "*fp8e4nv", "*fp32"),
    "int4": (launch.INT4, "*i8", "*bf16"),
}
WEIGHT_ELEMENTS = {"bf16": "bf16", "fp8": "f8E4M3FN", "int4": "i32"}  # int4: words of eight nibbles
POINTERS = ("x_ptr", "res_ptr", "res_out_ptr", "nw_ptr", "w_ptr", "scales_ptr", "offsets_ptr", "out_ptr", "live_ptr")


def census(kind: str, n_out: int, k: int, silu: bool = False, group: int = 128) -> dict:
    """Compile the fused norm + GEMV (+ SiLU) for one row of x, as CudaKernels.gemv would launch it (int4 weights
    in groups of `group` columns)."""
    wkind, w_type, scale_type = KINDS[kind]
    group = group if wkind == launch.INT4 else 1
    rows_of_w = 2 * n_out if silu else n_out
    block_n, warps = launch.gemv_config(rows_of_w, k, wkind)
    block_k, block_kb = launch.gemv_k_pieces(rows_of_w, k, group)
    fn = gemv._norm_gemv_kernel
    ints = {"K": k, "N_OUT": n_out, "X_PARTS": 0}
    signature = {name: "*bf16" for name in POINTERS} | {
        "w_ptr": w_type,
        "scales_ptr": scale_type,
        "offsets_ptr": scale_type,
        "eps": "fp32",
    }
    signature |= {name: "i32" for name in ints}
    constants = dict(
        ROWS=1,
        HAS_NORM=True,
        HAS_RES=True,
        SILU=silu,
        WKIND=wkind,
        GROUP=group,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_KB=block_kb,
        ROW_BLOCK=1,
        LIVE=False,
        PDL=True,
        PACKED=False,
        P_BLOCK=1,
        QOUT=False,
        QRES=False,
        QNORM=False,
        Q_PBLOCK=1,
    )
    signature |= {name: "constexpr" for name in constants}
    divisible = list(POINTERS) + [name for name, value in ints.items() if value % 16 == 0]
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(fn.arg_names.index(name),): value for name, value in constants.items()},
        attrs={(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible},
    )
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptx = compiled.asm["ptx"]
    lines = [line.split() for line in ptx.splitlines()]
    lines = [words for words in lines if words and not words[0].startswith(("//", ".", "$", "{", "}", ")"))]
    ops = [words[1] if words[0].startswith("@") else words[0] for words in lines]  # "@%p1 ld.global ...": predicated
    names = Counter(op.split(".")[0] for op in ops)
    return {
        "kind": kind,
        "n_out": n_out,
        "k": k,
        "silu": silu,
        "group": group,
        "block_n": block_n,
        "warps": warps,
        "pieces": [block_k, block_kb],
        "instructions": len(ops),
        **{name: names[name] for name in ("shfl", "bar", "dp4a")},
        "global_loads": dict(Counter(op for op in ops if op.startswith("ld.global"))),
        "weight_elements_a_load": weight_vector(compiled.asm["ttgir"], WEIGHT_ELEMENTS[kind]),
    }


def weight_vector(ttgir: str, element: str) -> list[int]:
    """Elements of the weight one thread reads at a time, for each of the kernel's 2-D loads of the weight's
    element type in program order (a row's first piece, then its second; gate rows, then up rows): the last
    sizePerThread of the load's layout (0: a layout that is not blocked)."""
    layouts = dict(re.findall(r"^(#\w+) = #ttg\.blocked<\{sizePerThread = \[[\d, ]*?(\d+)\]", ttgir, re.M))
    loads = re.findall(r"tt\.load .*: tensor<\d+x\d+x!tt\.ptr<(\w+)>, (#\w+)>", ttgir)
    return [int(layouts.get(layout, 0)) for elem, layout in loads if elem == element]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", choices=sorted(KINDS), default="int4")
    p.add_argument("--shape", default="6144x2560", help="outputs x columns of the weight (gate/up: each half's)")
    p.add_argument("--silu", action="store_true", help="gate/up with SiLU-and-mul: the weight holds 2 x outputs rows")
    p.add_argument("--group", type=int, default=128, help="int4 columns a scale (GGUF's Q4 blocks: 32)")
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)
    try:
        n_out, k = (int(v) for v in args.shape.lower().split("x"))
    except ValueError:
        p.error(f"--shape {args.shape!r}: give outputs x columns, e.g. 6144x2560")
    row = census(args.kind, n_out, k, args.silu, args.group)
    print(json.dumps(row))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
