"""The rknn-toolkit2 simulator bridge: a worker process started with the toolkit venv's python builds and runs the
exported graphs. Here that python is ours with a stand-in `rknn.api` (tests/fixtures/rknn_toolkit2: the real RKNN
signatures and return codes, onnxruntime as its simulator) on its PYTHONPATH."""

import sys
from pathlib import Path

import numpy as np
import pytest

from conformance_helpers import conformance, env_with
from flashnext.core.engine.engine import LLMEngine
from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.errors import UserError
from flashnext.core.llm import resolve_profile
from flashnext.plugins.rknpu import RknpuBackend
from flashnext.plugins.rknpu.runtime import NpuRuntimeError, StaticModel

FAKE_TOOLKIT = Path(__file__).parent / "fixtures" / "rknn_toolkit2"
PROMPT = [5, 9, 33, 70, 101, 7, 40, 41, 42, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]


def fake_python(folder: Path, fault: str = "", toolkit: Path | None = FAKE_TOOLKIT) -> str:
    """A toolkit venv's python as a script: ours, with the stand-in toolkit on PYTHONPATH and FAKE_RKNN_* set."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "python"
    pythonpath = f"PYTHONPATH={toolkit} " if toolkit else "PYTHONPATH= "
    path.write_text(
        f"#!/bin/sh\n{pythonpath}FAKE_RKNN_FAULT={fault} FAKE_RKNN_LOG={folder / 'calls.log'} "
        f'exec {sys.executable} "$@"\n'
    )
    path.chmod(0o755)
    return str(path)


def greedy(model: StaticModel, steps: int = 6) -> tuple[list[int], list[np.ndarray]]:
    logits = [model.prefill(0, PROMPT, 0)[-1]]
    for i in range(steps):
        logits.append(model.decode({0: (int(logits[-1].argmax()), len(PROMPT) + i)})[0])
    return [int(x.argmax()) for x in logits], logits


def test_simulator_sessions_give_onnxruntime_outputs_and_build_each_graph_once(rknpu_export, tmp_path):
    folder = rknpu_export[0]
    python = fake_python(tmp_path / "venv")
    want, want_logits = greedy(StaticModel.open(folder, "onnxruntime"))
    first = StaticModel.open(folder, "simulator", toolkit_python=python)
    got, got_logits = greedy(first)
    assert got == want
    np.testing.assert_array_equal(np.stack(got_logits), np.stack(want_logits))  # arrays cross the pipes intact
    assert [s.cached for s in first.sessions.values()] == [False, False]
    first.release()
    again = StaticModel.open(folder, "simulator", toolkit_python=python)
    assert [s.cached for s in again.sessions.values()] == [True, True]  # same hash: the worker's build is reused
    calls = (tmp_path / "venv" / "calls.log").read_text().splitlines()
    assert sorted(c for c in calls if c.startswith("build")) == [
        f"build {folder / 'decode.onnx'}",
        f"build {folder / 'prefill.onnx'}",
    ]
    assert "config rk3588" in calls and "init_runtime None" in calls  # no target: the simulator


@pytest.mark.parametrize(
    "fault, message",
    [
        (
            "build",
            r"decode.onnx: rknn-toolkit2 2.5.0 simulator load failed: RuntimeError: build returned -1 .*; its log: ",
        ),
        (
            "init_runtime",
            r"decode.onnx: rknn-toolkit2 2.5.0 simulator load failed: RuntimeError: init_runtime returned -1",
        ),
        ("inference", r"prefill.onnx: rknn-toolkit2 2.5.0 simulator run failed: RuntimeError: inference returned None"),
        (
            "crash",
            r"rknn-toolkit2 worker \(.*python\) exited with code 139 while run of .*prefill.onnx; its last line: "
            r"'Segmentation fault \(core dumped\)'; full log: .*flashnext-rknn-toolkit-.*\.log",
        ),
    ],
)
def test_each_toolkit_failure_is_one_clear_error(rknpu_export, tmp_path, fault, message):
    model = None
    with pytest.raises(NpuRuntimeError, match=message) as err:
        model = StaticModel.open(rknpu_export[0], "simulator", toolkit_python=fake_python(tmp_path, fault))
        model.prefill(0, PROMPT, 0)
    assert "\n" not in str(err.value)
    assert (model is None) == (fault in ("build", "init_runtime"))


def test_a_python_without_the_toolkit_or_no_python_at_all_is_named(rknpu_export, tmp_path):
    bare = fake_python(tmp_path, toolkit=None)
    with pytest.raises(NpuRuntimeError, match=r"exited with code 1 while starting; its last line: \"ModuleNotFound"):
        StaticModel.open(rknpu_export[0], "simulator", toolkit_python=bare)
    with pytest.raises(UserError, match=r"FLASHNEXT_RKNN_TOOLKIT_PYTHON=/nowhere/python: no such file"):
        StaticModel.open(rknpu_export[0], "simulator", toolkit_python="/nowhere/python")


def test_the_default_profile_is_the_simulator_where_a_toolkit_python_is_set(rknpu_export, tmp_path, monkeypatch):
    python = fake_python(tmp_path / "venv")
    monkeypatch.setenv("FLASHNEXT_RKNN_TOOLKIT_PYTHON", python)
    backend = RknpuBackend()
    profile = backend.profiles()[backend.default_profile]
    assert (profile.name, profile.runtime, profile.rknn_toolkit_python) == ("simulator", "simulator", python)
    assert profile.executed_on() == f"rknn-toolkit2 simulator (fp16, rk3588; {python})"
    probe = backend.probe()
    assert (probe.facts["runtime"], probe.facts["rknn_toolkit_python"]) == ("simulator", python)
    assert "graphs run in rknn-toolkit2's simulator" in probe.reason and probe.score == 0.5
    engine = LLMEngine(backend, backend.load_model(str(rknpu_export[0])), None, resolve_profile(backend, None, {}))
    (seq,) = engine.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True))
    want = LLMEngine(
        backend, backend.load_model(str(rknpu_export[0])), None, resolve_profile(backend, "onnxruntime", {})
    ).generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert seq.output_ids == want.output_ids
    monkeypatch.setenv("FLASHNEXT_RKNN_TOOLKIT_PYTHON", "")
    backend = RknpuBackend()
    assert backend.default_profile == "onnxruntime"
    assert backend.profiles()["onnxruntime"].executed_on() == "onnxruntime on the CPU (fp32)"
    assert backend.probe().facts["runtime"] == "onnxruntime"


@pytest.mark.slow  # a conformance run in a subprocess
def test_conformance_says_where_its_engine_cases_ran(tmp_path):
    python = fake_python(tmp_path / "venv")
    env = env_with([], FLASHNEXT_RKNN_TOOLKIT_PYTHON=python)
    code, report, _, proc = conformance("rknpu", tmp_path, env, select="batch_invariance")
    assert code == 0, proc.stdout[-3000:]
    assert report["profile"] == "simulator" and report["passed"] >= 1 and report["failed"] == 0
    assert report["executed_on"] == f"rknn-toolkit2 simulator (fp16, rk3588; {python})"
    assert "engine cases ran on rknn-toolkit2 simulator" in " ".join(proc.stdout.split())
    calls = (tmp_path / "venv" / "calls.log").read_text()
    assert "build " in calls and "inference " in calls
