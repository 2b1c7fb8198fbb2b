"""The rknpu runtime: rknn-toolkit-lite2's return codes turned into errors, and the engine's contract on the
static graphs (queueing past four sequences, the max_tokens cap, fp8 refused, the same tokens as the CPU)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flashnext.core.cli import app
from flashnext.core.engine.engine import LLMEngine
from flashnext.core.engine.sequence import SamplingParams, Status
from flashnext.core.errors import UserError
from flashnext.core.llm import resolve_profile
from flashnext.plugins.cpu import CpuBackend
from flashnext.plugins.rknpu import RknpuBackend
from flashnext.plugins.rknpu.runtime import NpuRuntimeError, RknnLiteSession
from rknpu_fakes import FakeRKNNLite, converted_copy, fake_rknnlite

ROCK5B = Path(__file__).parent / "fixtures" / "rk3588" / "rock5b"
PROMPTS = [[5, 9, 33, 70, 101, 7], [40, 41, 42], list(range(60, 100)), [200, 3], [17] * 20]
CAP_WARNING = (
    "max_tokens {asked} lowered to 64: a request of backend 'rknpu' (profile 'onnxruntime', max_tokens_cap) "
    "answers at most 64 tokens, then ends with finish_reason length"
)


@pytest.fixture(scope="module")
def converted(rknpu_export, tmp_path_factory):
    return converted_copy(rknpu_export[0], tmp_path_factory.mktemp("rknn") / "tiny")


def engine(backend, folder, profile=None, **overrides):
    loaded = backend.load_model(str(folder))
    return LLMEngine(backend, loaded, None, resolve_profile(backend, profile, overrides))


@pytest.mark.parametrize(
    "call, message",
    [
        ("load_rknn", "load_rknn failed"),
        ("init_runtime", r"init_runtime\(core_mask=7\) failed"),
        ("inference", "inference returned no outputs"),
    ],
)
def test_each_failed_rknnlite_call_is_one_clear_error(converted, call, message):
    module = fake_rknnlite()
    FakeRKNNLite.fail = {call}
    with pytest.raises(NpuRuntimeError, match=message) as err:
        session = RknnLiteSession(converted / "decode.rknn", 7, module)
        session.run([])
    assert "decode.rknn" in str(err.value)
    if call == "init_runtime":  # a context that failed to start is released
        assert FakeRKNNLite.log[-1] == ("release", None)


def test_npu_profile_runs_the_rknn_graphs_on_the_cores_it_names(converted, rknpu_export):
    module = fake_rknnlite()
    npu = engine(RknpuBackend(ROCK5B, rknnlite=module), converted, npu_cores="0_1")
    assert npu.profile.name == "npu" and npu.profile.runtime == "rknnlite"
    assert ("init_runtime", 3) in FakeRKNNLite.log
    loads = [arg for call, arg in FakeRKNNLite.log if call == "load_rknn"]
    assert sorted(Path(p).name for p in loads) == ["decode.rknn", "prefill.rknn"]
    onnx = engine(RknpuBackend(ROCK5B), rknpu_export[0], "onnxruntime")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert [s.output_ids for s in npu.generate(PROMPTS[:2], params)] == [
        s.output_ids for s in onnx.generate(PROMPTS[:2], params)
    ]
    assert any(call == "inference" for call, _ in FakeRKNNLite.log)


def test_a_folder_without_rknn_files_is_refused_on_the_npu(rknpu_export):
    with pytest.raises(UserError, match="no .rknn file.*--profile onnxruntime"):
        engine(RknpuBackend(ROCK5B, rknnlite=fake_rknnlite()), rknpu_export[0])


def test_same_greedy_tokens_as_the_cpu_backend_at_int4(rknpu_export, tiny_llama):
    from flashnext.core.loader import load_model

    params = SamplingParams(max_tokens=16, ignore_eos=True)
    got = [s.output_ids for s in engine(RknpuBackend(), rknpu_export[0]).generate(PROMPTS[1:4], params)]
    cpu = CpuBackend()
    ref = LLMEngine(cpu, load_model(str(tiny_llama)), "int4", resolve_profile(cpu, None, {}))
    assert got == [s.output_ids for s in ref.generate(PROMPTS[1:4], params)]


def test_a_fifth_concurrent_request_queues_then_finishes(rknpu_export):
    eng = engine(RknpuBackend(), rknpu_export[0])
    seqs = [eng.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in PROMPTS]
    queued_behind_four = False
    while eng.has_work():
        eng.step()
        running = [s.status for s in seqs].count(Status.RUNNING)
        assert running <= 4
        queued_behind_four |= running == 4 and seqs[4].status is Status.WAITING
    assert queued_behind_four
    assert all(s.finish_reason == "length" and len(s.output_ids) == 8 for s in seqs)


def test_prompt_chunks_follow_the_graph_chunk(rknpu_export):
    eng = engine(RknpuBackend(), rknpu_export[0], max_num_batched_tokens=16)
    seq = eng.add_request(PROMPTS[2], SamplingParams(max_tokens=2, ignore_eos=True))
    eng.step()
    assert seq.num_computed == 16  # 40 tokens: 16 + 16 + 8


def test_max_tokens_above_the_cap_is_clamped_or_refused(rknpu_export):
    eng = engine(RknpuBackend(), rknpu_export[0])
    (seq,) = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(seq.output_ids) == 64 and seq.finish_reason == "length"
    strict = engine(RknpuBackend(), rknpu_export[0], max_tokens_over_cap="refuse")
    with pytest.raises(UserError, match="max_tokens 100 is above the 64 a request of backend 'rknpu'"):
        strict.add_request(PROMPTS[0], SamplingParams(max_tokens=100))


def test_more_than_four_sequences_is_refused(rknpu_export):
    with pytest.raises(UserError, match="at most 4 sequences"):
        engine(RknpuBackend(), rknpu_export[0], max_num_seqs=8)


def test_cli_runs_the_exported_folder_and_refuses_fp8(rknpu_export):
    runner = CliRunner()
    folder = str(rknpu_export[0])
    result = runner.invoke(
        app, ["run", "hello", "--backend", "rknpu", "--model", folder, "--max-tokens", "80", "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["backend"] == "rknpu" and report["precision"] == "int4" and report["completion_tokens"] <= 64
    assert report["profile"]["runtime"] == "onnxruntime" and report["profile"]["max_tokens_cap"] == 64
    assert report["warning"] == CAP_WARNING.format(asked=80)
    within = runner.invoke(
        app, ["run", "hello", "--backend", "rknpu", "--model", folder, "--max-tokens", "3", "--json"]
    )
    assert within.exit_code == 0, within.output
    assert "warning" not in json.loads(within.stdout)
    result = runner.invoke(app, ["run", "hi", "--backend", "rknpu", "--model", folder, "--precision", "fp8-e4m3"])
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if not line.endswith(" s)")]  # progress stages before it
    assert errors == [
        (
            "error: backend 'rknpu' does not run fp8-e4m3: RK3588's NPU has no FP8 type "
            "and FP8 work falls back to the CPU at ~17x the latency; use --precision int4 "
            "(default) or fp16"
        )
    ]


def test_cli_plain_output_warns_once_on_stderr_when_max_tokens_is_clamped(rknpu_export):
    args = ["run", "hello", "--backend", "rknpu", "--model", str(rknpu_export[0]), "--no-warm-up"]
    result = CliRunner().invoke(app, [*args, "--max-tokens", "70"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: " + CAP_WARNING.format(asked=70)]
    assert CAP_WARNING.format(asked=70) not in result.stdout
    within = CliRunner().invoke(app, [*args, "--max-tokens", "2"])
    assert within.exit_code == 0, within.output
    assert "warning:" not in within.stderr


def test_a_checkpoint_given_directly_is_exported_on_the_fly(tiny_llama):
    eng = engine(RknpuBackend(), tiny_llama, max_model_len=64)
    assert eng.max_model_len == 64 and eng.runner.model.batch == 4
    (seq,) = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(seq.output_ids) == 5


def test_serve_queues_a_fifth_concurrent_request_and_caps_max_tokens(rknpu_export):
    """Five completions at once over HTTP: all answer (one waits for a slot), each at most 64 tokens."""
    from concurrent.futures import ThreadPoolExecutor

    from flashnext.core.llm import LLM
    from test_server import running

    llm = LLM(str(rknpu_export[0]), backend="rknpu")
    with running(llm) as client:
        body = {"model": llm.info.model, "prompt": "hello world", "max_tokens": 100, "ignore_eos": True}
        with ThreadPoolExecutor(5) as pool:
            replies = list(pool.map(lambda _: client.post("/v1/completions", json=body), range(5)))
        assert [r.status_code for r in replies] == [200] * 5, replies[0].text
        assert [r.json()["usage"]["completion_tokens"] for r in replies] == [64] * 5
        assert {r.json()["choices"][0]["finish_reason"] for r in replies} == {"length"}
        assert {r.json()["warning"] for r in replies} == {
            "max_tokens 100 lowered to 64: a request of backend 'rknpu' (profile 'onnxruntime', max_tokens_cap) "
            "answers at most 64 tokens, then ends with finish_reason length"
        }
        assert client.get("/health").json()["backend"] == "rknpu"
