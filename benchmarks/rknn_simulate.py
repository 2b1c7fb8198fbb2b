"""Convert an exported rk3588 folder with rknn-toolkit2 and compare its simulator with onnxruntime, greedily.

Run through benchmarks/rknn_simulate.sh (it makes the toolkit's venv). For each graph: RKNN().config(rk3588),
load_onnx, build(do_quantization=False) (fp16 on the NPU), export_rknn, init_runtime() with no target, which is
the simulator (it runs only a model built in the same process). Then one prompt runs through the prefill graph and
--steps greedy tokens through the decode graph on both, and the script prints and writes (--json) the tokens,
the logits' NMSE and the times. --decode-only converts only the decode graph (the prefill graph's build is the
slow one at full size) and feeds the prompt through it a token a call, in slot 0 with the other rows idle, as the
runtime's decode steps do.

    python benchmarks/rknn_simulate.py EXPORTED_FOLDER [OUT_FOLDER] [--steps 32] [--decode-only] [--json PATH]
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np


class SimulatorSession:
    """A built RKNN object in the simulator, with OnnxSession's interface; checks every return code."""

    def __init__(self, rknn, name: str):
        self.rknn, self.name = rknn, name

    def run(self, inputs):
        outputs = self.rknn.inference(inputs=inputs, data_format=["nchw"] * len(inputs))
        if outputs is None:
            raise RuntimeError(f"{self.name}: simulator inference returned None")
        return outputs

    def release(self):
        self.rknn.release()


def convert(onnx_path: Path, rknn_path: Path):
    from flashnext.plugins.rknpu.toolkit_worker import build

    try:
        return build(str(onnx_path), "rk3588", export_to=str(rknn_path))
    except RuntimeError as err:
        sys.exit(f"{onnx_path.name}: {err}")


def nmse(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(((got - want) ** 2).sum() / max((want**2).sum(), 1e-30))


def greedy(model, prompt: list[int], steps: int, decode_only: bool) -> tuple[list[int], list[np.ndarray]]:
    if decode_only:
        logits = [[model.decode({0: (token, i)})[0] for i, token in enumerate(prompt)][-1]]
    else:
        logits = [model.prefill(0, prompt, 0)[-1]]
    tokens = [int(logits[-1].argmax())]
    for i in range(steps - 1):
        logits.append(model.decode({0: (tokens[-1], len(prompt) + i)})[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--decode-only", action="store_true", help="convert and run only the decode graph")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import rknn.api

    from flashnext.plugins.rknpu.runtime import StaticModel

    out = args.out or args.folder.with_name(args.folder.name + "-rknn")
    if out != args.folder:
        shutil.copytree(args.folder, out, dirs_exist_ok=True)
    manifest = json.loads((out / "manifest.json").read_text())
    version = getattr(rknn.api, "__version__", None) or _toolkit_version()
    sessions, build_s = {}, {}
    for name, graph in manifest["graphs"].items():
        if args.decode_only and name != "decode":
            continue
        start = time.perf_counter()
        sessions[name] = SimulatorSession(convert(out / graph["onnx"], out / f"{name}.rknn"), name)
        build_s[name] = round(time.perf_counter() - start, 1)
        graph["rknn"] = f"{name}.rknn"
    manifest["toolkit"] = f"rknn-toolkit2 {version} (target rk3588, do_quantization=False: fp16)"
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))

    reference = StaticModel.open(out, "onnxruntime")
    simulated = StaticModel(reference.config, reference.embed, sessions, manifest, out)
    prompt = [
        int(t) for t in np.arange(3, 3 + manifest["chunk"] + manifest["chunk"] // 2) % reference.config.vocab_size
    ]
    start = time.perf_counter()
    want, want_logits = greedy(reference, prompt, args.steps, args.decode_only)
    onnx_s = time.perf_counter() - start
    start = time.perf_counter()
    got, got_logits = greedy(simulated, prompt, args.steps, args.decode_only)
    sim_s = time.perf_counter() - start
    same_prefix = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    report = {
        "folder": str(out),
        "toolkit": manifest["toolkit"],
        "build_s": build_s,
        "prompt_tokens": len(prompt),
        "prompt_through": "decode" if args.decode_only else "prefill",
        "steps": args.steps,
        "onnxruntime_tokens": want,
        "simulator_tokens": got,
        "tokens_equal": sum(a == b for a, b in zip(got, want)),
        "first_difference": same_prefix,
        "first_logits_nmse": nmse(got_logits[0], want_logits[0]),
        "logits_nmse_over_equal_prefix": nmse(
            np.stack(got_logits[: same_prefix + 1]), np.stack(want_logits[: same_prefix + 1])
        ),
        "onnxruntime_s": round(onnx_s, 2),
        "simulator_s": round(sim_s, 2),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def _toolkit_version() -> str:
    from importlib.metadata import version

    return version("rknn-toolkit2")


if __name__ == "__main__":
    main()
