"""`flashnext export --target rk3588`: the decoder as static-shape ONNX graphs, checked with onnxruntime against
the core's own forward pass before anything is converted for the NPU.

The folder holds decode.onnx (batch 4, one token) and prefill.onnx (batch 1, a chunk of tokens) sharing one
weights file, the host-side embedding table, the tokenizer, config.json and manifest.json (shapes, precision,
opset, the checks and their numbers). Projections are the core's weights in the asked precision; int4 ones enter
the graph as their exact int4 grid values (q * scale + offset) in float32 initializers, which the RKNN converter
stores as fp16 (see docs/backends.md for what that costs and what the true INT4 path is).
"""

import hashlib
import json
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch

from flashnext.core.engine.runner import ModelRunner, RunnerSetup
from flashnext.core.engine.scheduler import ScheduledSeq
from flashnext.core.engine.sequence import SamplingParams, Sequence
from flashnext.core.errors import FlashnextError, UserError
from flashnext.core.kernels import ReferenceKernels
from flashnext.core.loader import LoadedModel
from flashnext.core.model import DecoderModel
from flashnext.core.precision import PRECISIONS

from .graph import GraphShape, StaticDecoder, dense, example_inputs, input_names, output_names
from .runtime import MANIFEST, StaticModel

TARGETS = ("rk3588",)
# The precisions an RK3588 graph can carry: int4 weights as their grid (16-bit on the NPU), or 16-bit weights.
# FP8 has no NPU path on RK3588: it falls back to the CPU at ~17x the latency.
EXPORT_PRECISIONS = ("int4", "fp16")
MAX_BATCH = 4
# rknn-toolkit2 2.5 reads ONNX up to opset 19; 17 is what its own examples export.
OPSET = 17
WEIGHTS_FILE = "weights.bin"
CHECK_TEXT = "The quick brown fox jumps over the lazy dog. To be, or not to be, that is the question. "
DECODE_STEPS = 32
# Both sides compute in float32 from the same weights: what is left is summation order.
MAX_NMSE = 1e-6


def check_precision(precision: str) -> None:
    if precision.startswith("fp8"):
        raise UserError(
            f"--precision {precision}: RK3588's NPU has no FP8; it would fall back to the CPU at ~17x "
            f"the latency; use --precision int4 (default) or fp16"
        )
    if precision not in EXPORT_PRECISIONS:
        raise UserError(f"--precision {precision}: an rk3588 export takes {' or '.join(EXPORT_PRECISIONS)}")


def export(
    loaded: LoadedModel,
    out: Path,
    target: str = "rk3588",
    precision: str = "int4",
    batch: int = MAX_BATCH,
    chunk: int = 32,
    context: int = 512,
    check: bool = True,
) -> dict:
    """Write the folder and return its manifest; raises when a graph disagrees with the core's forward pass."""
    if target not in TARGETS:
        raise UserError(f"--target {target}: exports exist for {', '.join(TARGETS)}")
    check_precision(precision)
    if not 1 <= batch <= MAX_BATCH:
        raise UserError(f"--batch {batch}: the RK3588 graphs take 1 to {MAX_BATCH} sequences")
    limit = loaded.config.max_position_embeddings
    if context > limit or chunk > context:
        raise UserError(f"--context {context}: at most the model's {limit} and at least --chunk {chunk}")
    out.mkdir(parents=True, exist_ok=True)
    (out / WEIGHTS_FILE).unlink(missing_ok=True)
    config = loaded.config.model_copy(update={"max_position_embeddings": context})
    model = DecoderModel(
        config, loaded.weights, ReferenceKernels(), PRECISIONS[precision], torch.device("cpu"), torch.float32
    )
    expand_projections(model)
    shapes = [GraphShape(batch, 1, context), GraphShape(1, chunk, context)]
    start = time.perf_counter()
    graphs = write_graphs(StaticDecoder(model).eval(), config, shapes, out)
    np.save(out / "embedding.npy", model.embed.numpy())
    (out / "config.json").write_text(json.dumps(config.model_dump(), indent=2))
    write_tokenizer(loaded, out)
    manifest = {
        "format": "flashnext-rknpu/1",
        "target": target,
        "model": loaded.name,
        "source": loaded.source,
        "precision": precision,
        "weights_in_graph": weights_note(precision),
        "batch": batch,
        "chunk": chunk,
        "context": context,
        "opset": OPSET,
        "graphs": graphs,
        "embedding": "embedding.npy",
        "weights_file": WEIGHTS_FILE,
        "bytes": {name.name: name.stat().st_size for name in sorted(out.iterdir()) if name.is_file()},
        "export_s": round(time.perf_counter() - start, 2),
        "toolkit": None,  # rknn-toolkit2 version once the graphs are converted (benchmarks/rknn_simulate.py)
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    if check:
        manifest["checks"] = check_against_core(model, loaded, out)
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if not manifest["checks"]["passed"]:
            raise FlashnextError(
                f"{out}: the exported graphs disagree with the core's forward pass "
                f"({json.dumps(manifest['checks'])}); the folder is kept for inspection"
            )
    return manifest


def expand_projections(model: DecoderModel) -> None:
    """Projections as their float32 values, once: the same numbers the reference kernels would dequantize on
    every call of the check's forward passes."""
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(layer, name, dense(getattr(layer, name)))


def weights_note(precision: str) -> str:
    if precision == "int4":
        return (
            "int4 grid values (q * scale + offset, groups of the core's Int4Weight) as float32 initializers; "
            "fp16 once converted for the NPU"
        )
    return "fp16-rounded weights as float32 initializers"


def write_graphs(module: StaticDecoder, config, shapes: list[GraphShape], out: Path) -> dict:
    """Each shape exported with the legacy TorchScript exporter (static shapes, no dynamic axes; it needs no
    onnxscript, and the shapes are fixed so the dynamo exporter's symbolic shapes buy nothing), then all graphs
    pointed at one weights file: the second graph's initializers reuse the first one's bytes."""
    graphs, shared = {}, {}
    for shape in shapes:
        path = out / f"{shape.name}.onnx"
        module.shape = shape
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the legacy exporter, chosen above
            torch.onnx.export(
                module,
                example_inputs(config, shape),
                str(path),
                dynamo=False,
                opset_version=OPSET,
                input_names=input_names(config.num_layers),
                output_names=output_names(config.num_layers),
                do_constant_folding=True,
            )
        proto = onnx.load(str(path))
        share_weights(proto, shared, out)
        onnx.save_model(proto, str(path))
        graphs[shape.name] = {
            "onnx": path.name,
            "batch": shape.batch,
            "tokens": shape.tokens,
            "inputs": io_shapes(proto.graph.input),
            "outputs": io_shapes(proto.graph.output),
        }
    return graphs


def share_weights(proto: onnx.ModelProto, shared: dict, out: Path) -> None:
    """Move initializers of at least 1 KiB into WEIGHTS_FILE, once per distinct (name, bytes)."""
    with open(out / WEIGHTS_FILE, "ab") as blob:
        for tensor in proto.graph.initializer:
            raw = onnx.numpy_helper.to_array(tensor).tobytes()
            if len(raw) < 1024:
                continue
            key = (tensor.name, hashlib.sha1(raw).hexdigest())
            if key not in shared:
                shared[key] = (blob.tell(), len(raw))
                blob.write(raw)
            offset, length = shared[key]
            tensor.ClearField("raw_data")
            tensor.ClearField("float_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for k, v in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(length))):
                tensor.external_data.add(key=k, value=v)


def io_shapes(values) -> dict:
    return {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}


def write_tokenizer(loaded: LoadedModel, out: Path) -> None:
    tok = loaded.tokenizer
    tok.backend.save(str(out / "tokenizer.json"))
    name = tok.id_to_token
    cfg = {
        "bos_token": name(tok.bos_token_id) if tok.bos_token_id is not None else None,
        "eos_token": name(tok.eos_token_ids[0]) if tok.eos_token_ids else None,
        "add_bos_token": tok.add_bos,
        "chat_template": tok.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_ids})
    )


def check_prompt(loaded: LoadedModel, chunk: int) -> list[int]:
    """A prompt longer than one chunk, so that the check crosses a chunk boundary."""
    ids = loaded.tokenizer.encode(CHECK_TEXT)
    while len(ids) < chunk + chunk // 2:
        ids += ids
    return ids[: chunk + chunk // 2]


def check_against_core(model: DecoderModel, loaded: LoadedModel, out: Path) -> dict:
    """onnxruntime runs the prompt through the prefill graph and DECODE_STEPS tokens through the decode graph (in
    cache slot 1 of the batch, the others idle), fed the core's greedy tokens; logits NMSE and argmax agreement."""
    static = StaticModel.open(out, "onnxruntime")
    prompt = check_prompt(loaded, static.chunk)
    ref_prompt, ref_tokens, ref_decode = core_greedy(model, prompt, DECODE_STEPS)
    slot = min(1, static.batch - 1)
    got_prompt = static.prefill(slot, prompt, 0)
    got_decode = np.stack([static.decode({slot: (tok, len(prompt) + i)})[slot] for i, tok in enumerate(ref_tokens)])
    static.release()
    got_tokens = [int(got_prompt[-1].argmax())] + [int(row.argmax()) for row in got_decode[:-1]]
    prefill_nmse, decode_nmse = nmse(got_prompt, ref_prompt), nmse(got_decode, ref_decode)
    same = sum(a == b for a, b in zip(got_tokens, ref_tokens))
    return {
        "runtime": f"onnxruntime {__import__('onnxruntime').__version__} (CPU, float32)",
        "reference": "core DecoderModel, ReferenceKernels, float32 activations, the same weights",
        "prompt_tokens": len(prompt),
        "decode_steps": DECODE_STEPS,
        "prefill_logits_nmse": prefill_nmse,
        "decode_logits_nmse": decode_nmse,
        "greedy_tokens_equal": same,
        "max_nmse": MAX_NMSE,
        "passed": prefill_nmse <= MAX_NMSE and decode_nmse <= MAX_NMSE and same == DECODE_STEPS,
    }


def core_greedy(model: DecoderModel, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int], np.ndarray]:
    """The core's forward pass: logits of every prompt token, then `steps` greedy tokens with their logits."""
    block = 16
    blocks = -(-(len(prompt) + steps) // block)
    runner = ModelRunner(model, RunnerSetup(blocks, block, torch.float32))
    seq = Sequence(list(prompt), SamplingParams(max_tokens=steps, ignore_eos=True))
    seq.block_table = list(range(blocks))
    logits, _ = runner.run([ScheduledSeq(seq, len(prompt), len(prompt))])
    prompt_logits, decode_logits, tokens = logits.numpy(), [], []
    seq.num_computed = len(prompt)
    token = int(logits[-1].argmax())
    for _ in range(steps):
        tokens.append(token)
        seq.token_ids.append(token)
        step_logits, _ = runner.run([ScheduledSeq(seq, 1, 1)])
        seq.num_computed += 1
        decode_logits.append(step_logits[0].numpy())
        token = int(step_logits[0].argmax())
    return prompt_logits, tokens, np.stack(decode_logits)


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(((got - want) ** 2).sum() / max((want**2).sum(), 1e-30))
