"""The `flashnext` command line: flags, JSON shapes and one-line errors (docs/cli.md)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flashnext.core.cli import app

runner = CliRunner()


def invoke(*args, input=None):
    return runner.invoke(app, list(args), input=input)


def test_backends_json_lists_cpu_available_and_cuda_with_reason():
    result = invoke("backends", "--json")
    assert result.exit_code == 0
    entries = {e["name"]: e for e in json.loads(result.stdout)}
    cpu = entries["cpu"]
    assert cpu["available"] is True and cpu["score"] > 0
    assert cpu["origin"].startswith("flashnext ")
    assert set(cpu["precisions"]) == {"fp32", "bf16", "fp16", "fp8-e4m3", "fp8-e5m2", "int4"}
    assert cpu["features"]["prefix_caching"] is True
    for entry in entries.values():
        assert {"name", "available", "score", "reason", "origin", "precisions", "features"} <= set(entry)
    if "cuda" in entries and not entries["cuda"]["available"]:
        assert "CUDA" in entries["cuda"]["reason"] or "GPU" in entries["cuda"]["reason"]


def test_backends_table_mentions_every_backend():
    result = invoke("backends")
    assert result.exit_code == 0
    assert "cpu" in result.stdout and "cuda" in result.stdout


def test_run_json_has_the_contract_keys(tiny_llama):
    result = invoke("run", "hello world", "--model", str(tiny_llama), "--backend", "cpu", "--max-tokens", "5", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    for key in (
        "text",
        "token_ids",
        "prompt_tokens",
        "completion_tokens",
        "finish_reason",
        "backend",
        "model",
        "precision",
        "profile",
        "timing",
        "spec",
    ):
        assert key in report
    assert report["backend"] == "cpu" and report["precision"] == "fp32"
    assert report["completion_tokens"] == len(report["token_ids"]) <= 5
    assert set(report["timing"]) >= {"load_s", "ttft_s", "decode_tok_s"}
    assert set(report["spec"]) >= {"method", "drafted", "accepted"}
    assert report["profile"]["name"] == "full"


def slow_first_decode(monkeypatch) -> list[int]:
    """The first decode step does 0.3 s of one-time work, counted by the runner as CUDA's graph captures are."""
    from flashnext.core.engine.runner import ModelRunner

    real_step, steps = ModelRunner.step, []

    def step(self, inputs):
        steps.append(len(inputs.batch))
        if len(steps) == 2:  # the first decode step does 0.3 s of one-time work
            time.sleep(0.3)
            self.warm_up_s += 0.3
        return real_step(self, inputs)

    monkeypatch.setattr(ModelRunner, "step", step)
    return steps


def test_run_takes_one_time_warm_up_out_of_ttft_and_decode_speed(tiny_llama, monkeypatch):
    """Without the warm-up, a runner's one-time work inside the request's steps is reported as warm_up_s, not as
    slow decode."""
    steps = slow_first_decode(monkeypatch)
    result = invoke(
        "run",
        "hello world",
        "--model",
        str(tiny_llama),
        "--backend",
        "cpu",
        "--max-tokens",
        "6",
        "--json",
        "--no-warm-up",
    )
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    timing = report["timing"]
    assert report["completion_tokens"] >= 3 and len(steps) >= 2
    assert timing["warm_up_s"] == pytest.approx(0.3, abs=1e-3)
    decode_s = (report["completion_tokens"] - 1) / timing["decode_tok_s"]
    assert decode_s < 0.2 and timing["ttft_s"] < 0.2  # the warm-up's 0.3 s is in neither


def test_run_warms_up_before_the_request_by_default(tiny_llama, monkeypatch):
    """The warm-up request takes the first decode step's one-time work: the real request never sees it, and
    warm_up_s reports it with the warm-up's own time."""
    steps = slow_first_decode(monkeypatch)
    result = invoke("run", "hello world", "--model", str(tiny_llama), "--backend", "cpu", "--max-tokens", "6", "--json")
    assert result.exit_code == 0, result.stderr
    timing = json.loads(result.stdout)["timing"]
    assert len(steps) >= 4  # the warm-up's prefill and decode, then the request's
    assert 0.3 <= timing["warm_up_s"] < 5 and timing["ttft_s"] < 0.2


@pytest.mark.parametrize(
    "raised,said",
    [
        (
            "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity",
            "out of device memory allocating 2.00 GiB;",
        ),
        ("RuntimeError: CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation'", "out of device memory;"),
    ],
)
def test_running_out_of_device_memory_is_one_line_with_the_settings_to_lower(tiny_llama, monkeypatch, raised, said):
    """Out of memory past the weights check (KV cache, a capture, a big prefill; from torch's allocator or, as a
    stream on a nearly full H200 did, the driver) is a runtime failure (exit 1) in one line naming what to lower,
    not an "internal error"."""
    import torch

    from flashnext.core.engine.runner import ModelRunner

    kind, text = raised.split(": ", 1)

    def step(self, inputs):
        raise (torch.OutOfMemoryError if kind == "OutOfMemoryError" else RuntimeError)(text)

    monkeypatch.setattr(ModelRunner, "step", step)
    result = invoke("run", "hello", "--model", str(tiny_llama), "--backend", "cpu")
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]  # after the stage lines
    assert errors == [
        f"error: {said} lower --max-model-len, FLASHNEXT_MAX_NUM_SEQS or "
        "FLASHNEXT_MEMORY_UTILIZATION, or use a smaller --precision"
    ]
    assert "Traceback" not in result.stderr


def test_run_reads_prompt_from_stdin_and_is_deterministic(tiny_llama):
    args = ["run", "--model", str(tiny_llama), "--backend", "cpu", "--max-tokens", "6", "--json"]
    a = json.loads(invoke(*args, input="the quick brown fox").stdout)
    b = json.loads(invoke(*args, "the quick brown fox").stdout)
    assert a["token_ids"] == b["token_ids"] and a["prompt_tokens"] == b["prompt_tokens"] > 0


def test_seeded_sampling_repeats_and_differs_from_other_seed(tiny_llama):
    base = [
        "run",
        "once upon a time",
        "--model",
        str(tiny_llama),
        "--backend",
        "cpu",
        "--max-tokens",
        "12",
        "--temperature",
        "1.5",
        "--json",
    ]
    one = json.loads(invoke(*base, "--seed", "1").stdout)["token_ids"]
    again = json.loads(invoke(*base, "--seed", "1").stdout)["token_ids"]
    other = json.loads(invoke(*base, "--seed", "2").stdout)["token_ids"]
    assert one == again
    assert one != other


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--backend", "nope"], "unknown backend 'nope'"),
        (["--precision", "fp7"], "unknown precision 'fp7'"),
        (["--profile", "turbo"], "no profile 'turbo'"),
        (["--spec", "psychic"], "spec"),
        (["--model", "/no/such/model"], "/no/such/model"),
    ],
)
def test_bad_input_exits_2_with_one_line(tiny_llama, args, fragment):
    base = ["run", "hello", "--backend", "cpu", "--model", str(tiny_llama)]
    result = invoke(*base, *args)
    assert result.exit_code == 2, result.output
    *stages, error = result.stderr.strip().splitlines()
    assert error.startswith("error:") and fragment in error
    assert all(line.endswith(" s)") for line in stages)  # progress: one line per stage done before the error
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "precision, fragment",
    [("fp7", "unknown precision 'fp7': choose one of fp32, bf16"), ("fp8-e4m3", "fp8-e4m3")],
)
def test_refused_precision_exits_2_before_the_model_loads(monkeypatch, precision, fragment):
    from flashnext.core import loader

    monkeypatch.setattr(
        loader, "load_model", lambda spec: pytest.fail("the model loaded before --precision was checked")
    )
    args = ["run", "hello", "--model", "/never/loaded", "--precision", precision]
    result = invoke(*args, "--backend", "cpu" if precision == "fp7" else "rknpu")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]  # one line: no loading stage before it
    assert result.stderr.startswith("error:") and fragment in result.stderr and "Traceback" not in result.output


def test_empty_prompt_exits_2_before_the_model_loads(tiny_llama, monkeypatch):
    from flashnext.core import loader

    monkeypatch.setattr(loader, "load_model", lambda spec: pytest.fail("the model loaded before the prompt was read"))
    result = invoke("run", "   ", "--backend", "cpu", "--model", str(tiny_llama))
    assert result.exit_code == 2 and result.stderr.strip() == "error: the prompt is empty: give some text"


def test_prompt_longer_than_context_exits_2(tiny_llama):
    result = invoke("run", "word " * 200, "--backend", "cpu", "--model", str(tiny_llama), "--max-model-len", "32")
    assert result.exit_code == 2
    assert "context holds 32" in result.stderr


def test_unavailable_backend_explains_why(tiny_llama):
    from flashnext.core import registry

    unavailable = [e for e in registry.discover() if not e.probe.available]
    if not unavailable:
        pytest.skip("every installed backend is available on this machine")
    result = invoke("run", "hi", "--backend", unavailable[0].name, "--model", str(tiny_llama))
    assert result.exit_code == 2 and "not available here" in result.stderr


def test_explain_prints_every_probe_verdict(tiny_llama):
    result = invoke("run", "hi", "--backend", "auto", "--model", str(tiny_llama), "--max-tokens", "2", "--explain")
    assert result.exit_code == 0
    assert "[chosen] cpu" in result.stderr or "[chosen]" in result.stderr
    assert "cpu" in result.stderr


def test_explain_names_how_int4_steps_run(tiny_llama):
    result = invoke(
        "run",
        "hi",
        "--backend",
        "cpu",
        "--model",
        str(tiny_llama),
        "--precision",
        "int4",
        "--max-tokens",
        "2",
        "--explain",
    )
    assert result.exit_code == 0
    assert "steps: int4_route " in result.stderr
    fp32 = invoke("run", "hi", "--backend", "cpu", "--model", str(tiny_llama), "--max-tokens", "2", "--explain")
    assert fp32.exit_code == 0 and "steps:" not in fp32.stderr  # nothing beyond the backend's choice


@pytest.mark.slow
def test_the_readme_first_command_answers_cleanly():
    """The README's promise, as a user runs it: its own command line, the console script, the embedded model."""
    import shlex

    from test_readme import quick_start_commands

    command = shlex.split(quick_start_commands()[0].rsplit("&& ", 1)[1])
    assert command[:2] == ["flashnext", "run"]
    env = dict(os.environ, FLASHNEXT_BACKEND="cpu")
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "flashnext"), *command[1:]],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    answer = proc.stdout.strip()
    assert "Paris" in answer and "\n" not in answer and len(answer) < 80, answer  # one sentence, no ramble
    assert "tok/s" in proc.stderr and "cpu" in proc.stderr
