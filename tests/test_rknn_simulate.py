"""benchmarks/rknn_simulate.py's pieces that need no rknn-toolkit2: its arguments and its greedy routes, run on
the tiny exported folder through onnxruntime."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from flashnext.plugins.rknpu.runtime import StaticModel

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "rknn_simulate.py"


@pytest.fixture(scope="module")
def simulate():
    spec = importlib.util.spec_from_file_location("rknn_simulate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_only_is_off_unless_asked(simulate):
    args = simulate.parse_args(["IN", "OUT", "--steps", "16", "--decode-only"])
    assert (args.folder, args.out, args.steps, args.decode_only) == (Path("IN"), Path("OUT"), 16, True)
    assert simulate.parse_args(["IN"]).decode_only is False


def test_prompt_through_the_decode_graph_gives_the_prefill_route_tokens(simulate, rknpu_export):
    folder, manifest = rknpu_export
    prompt = [int(t) for t in np.arange(3, 3 + manifest["chunk"] + 5)]
    results = []
    for decode_only in (False, True):
        model = StaticModel.open(folder, "onnxruntime")
        results.append(simulate.greedy(model, prompt, 6, decode_only))
        model.release()
    (want, want_logits), (got, got_logits) = results
    assert got == want
    assert simulate.nmse(np.stack(got_logits), np.stack(want_logits)) < 1e-8
