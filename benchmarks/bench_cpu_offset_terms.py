"""What a Q4_1 offset term costs a MatMulNBits projection in onnxruntime, by how the graph could write it.

A chain of `--layers` x (576 -> 1,536, 1,536 -> 576) int4 projections (SmolLM2's widths, random codes, groups of
32), one session per layout, each run on the same input; microseconds a projection, medians of `--rounds`:

- `none`: MatMulNBits alone (symmetric weights: no offset to add; the floor);
- `integer-zp`: integer zero points, which MLAS folds into its kernel (timing only: a Q4_1 offset is a fraction of
  its scale, so this would round the weights);
- `matmul-gemm`: the shipped graph's term, group sums by a MatMul with a 0/1 matrix, then a Gemm onto the output;
- `reduce-gemm`: group sums by ReduceSum over a reshape;
- `rows-split`: the group sums as extra output rows of the projection itself (codes of one), split off.

    python benchmarks/bench_cpu_offset_terms.py --threads 1,2 --accuracy 1,4 --json out.json
"""

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_vs_hf import machine  # noqa: E402

LAYOUTS = ("none", "integer-zp", "matmul-gemm", "reduce-gemm", "rows-split")
GROUP = 32
WIDTHS = ((576, 1536), (1536, 576))  # (K, N) of each pair's two projections


class Chain:
    """An ONNX graph of chained projections, each with its offset term written one way."""

    def __init__(self, layout: str, accuracy: int, seed: int = 0):
        self.layout, self.accuracy = layout, accuracy
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.count, self.ones = [], [], 0, {}

    def name(self, stem: str) -> str:
        self.count += 1
        return f"{stem}{self.count}"

    def const(self, array: np.ndarray) -> str:
        name = self.name("c")
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(self, op: str, inputs: list[str], outputs: int = 1, domain: str = "", **attrs) -> list[str]:
        names = [self.name(op) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, names, domain=domain, **attrs))
        return names

    def projection(self, x: str, k: int, n: int) -> str:
        groups = k // GROUP
        codes = self.rng.integers(0, 256, (n, groups, GROUP // 2), dtype=np.uint8)
        scales = self.rng.random(n * groups, dtype=np.float32) * 0.01 + 0.001
        offsets = (self.rng.random((n, groups), dtype=np.float32) - 0.5) * 0.01
        rows = n
        if self.layout == "rows-split":  # row n + g: code 9 (one, past zero point 8) on group g, 8 elsewhere
            extra = np.full((groups, groups, GROUP // 2), 0x88, np.uint8)
            extra[np.arange(groups), np.arange(groups)] = 0x99
            codes, rows = np.concatenate([codes, extra]), n + groups
            scales = np.concatenate([scales, np.ones(groups * groups, np.float32)])
        inputs = [x, self.const(codes), self.const(scales)]
        if self.layout == "integer-zp":
            inputs.append(self.const(self.rng.integers(0, 256, (n, (groups + 1) // 2), dtype=np.uint8)))
        attrs = dict(K=k, N=rows, bits=4, block_size=GROUP, accuracy_level=self.accuracy)
        (y,) = self.node("MatMulNBits", inputs, domain="com.microsoft", **attrs)
        return self.offset_term(x, y, k, n, offsets)

    def offset_term(self, x: str, y: str, k: int, n: int, offsets: np.ndarray) -> str:
        groups = k // GROUP
        if self.layout in ("none", "integer-zp"):
            return y
        if self.layout == "matmul-gemm":
            if k not in self.ones:
                self.ones[k] = self.const(np.kron(np.eye(groups, dtype=np.float32), np.ones((GROUP, 1), np.float32)))
            (sums,) = self.node("MatMul", [x, self.ones[k]])
        elif self.layout == "reduce-gemm":
            (grouped,) = self.node("Reshape", [x, self.const(np.array([-1, groups, GROUP], np.int64))])
            (sums,) = self.node("ReduceSum", [grouped, self.const(np.array([-1], np.int64))], keepdims=0)
        else:  # rows-split
            y, sums = self.node("Split", [y, self.const(np.array([n, groups], np.int64))], outputs=2, axis=-1)
        return self.node("Gemm", [sums, self.const(offsets.T), y])[0]

    def build(self, layers: int) -> bytes:
        x = "x"
        for _ in range(layers):
            for k, n in WIDTHS:
                x = self.projection(x, k, n)
        self.nodes.append(helper.make_node("Identity", [x], ["y"]))
        io = [helper.make_tensor_value_info(v, TensorProto.FLOAT, [1, 576]) for v in ("x", "y")]
        graph = helper.make_graph(self.nodes, "offset_terms", io[:1], io[1:], self.inits)
        opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
        return helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()


def session(layout: str, accuracy: int, threads: int, layers: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.add_session_config_entry("session.intra_op.spin_duration_us", "20")  # as the CPU graph runs
    options.log_severity_level = 3
    return ort.InferenceSession(Chain(layout, accuracy).build(layers), options, providers=["CPUExecutionProvider"])


def measure(sessions: dict, rounds: int, calls: int) -> dict[str, list[float]]:
    """Microseconds a call of each session, `rounds` times, the order rotating."""
    x = np.random.default_rng(1).standard_normal((1, 576), dtype=np.float32) * 0.1
    samples = {layout: [] for layout in sessions}
    names = list(sessions)
    for i in range(rounds):
        for layout in names[i % len(names) :] + names[: i % len(names)]:
            s = sessions[layout]
            s.run(None, {"x": x})
            start = time.perf_counter()
            for _ in range(calls):
                s.run(None, {"x": x})
            samples[layout].append((time.perf_counter() - start) / calls * 1e6)
    return samples


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="2")
    p.add_argument("--accuracy", default="4", help="MatMulNBits accuracy levels: 1 float32, 4 int8 activations")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)
    meta = machine() | {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "layers": args.layers,
    }
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        for accuracy in (int(a) for a in args.accuracy.split(",")):
            layouts = args.layouts.split(",")
            sessions = {lay: session(lay, accuracy, threads, args.layers) for lay in layouts}
            samples = measure(sessions, args.rounds, args.calls)
            for layout in layouts:
                per_projection = statistics.median(samples[layout]) / (2 * args.layers)
                row = dict(threads=threads, accuracy=accuracy, layout=layout, us_per_projection=per_projection)
                rows.append(meta | row)
                print(f"threads {threads} accuracy {accuracy} {layout:>12}: {per_projection:6.1f} us a projection")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
