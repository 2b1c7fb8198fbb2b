"""What a newcomer meets first: thread count, stage progress, bench rows as they finish, honest warm-up, logs."""

import json

import pytest
import torch
from typer.testing import CliRunner

from flashnext.core import threads as threads_module
from flashnext.core.cli import app
from flashnext.core.errors import UserError
from flashnext.core.threads import apply_threads, choose_threads

runner = CliRunner()


@pytest.fixture
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def four_cores(monkeypatch):
    import psutil

    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)


@pytest.mark.parametrize("busy, threads", [(0.0, 4), (0.9, 3), (1.6, 2), (3.7, 1), (8.0, 1)])
def test_auto_threads_leave_out_the_cores_others_keep_busy(four_cores, busy, threads):
    choice = choose_threads(None, busy=busy)
    assert choice.threads == threads
    assert "4 physical cores" in choice.reason and f"{busy:.1f} busy" in choice.reason


def test_auto_threads_never_exceed_what_the_process_was_given(monkeypatch, four_cores):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # e.g. OMP_NUM_THREADS=1, or one pytest worker's share
    assert choose_threads(None, busy=0.0).threads == 1


def test_requested_threads_are_taken_as_given(four_cores):
    choice = choose_threads(6)
    assert choice.threads == 6 and "as set" in choice.reason


def test_busy_cores_of_others_leaves_this_process_out():
    """A sample while only this process sleeps: whatever others do, the result is a core count, not a percent."""
    busy = threads_module.busy_cores_of_others(0.05)
    import psutil

    assert 0.0 <= busy <= psutil.cpu_count()


def test_apply_threads_sets_torch(keep_torch_threads):
    apply_threads(choose_threads(1))
    assert torch.get_num_threads() == 1


def test_threads_from_env_and_flag_reach_torch_and_the_report(tiny_llama, monkeypatch, keep_torch_threads):
    monkeypatch.setenv("FLASHNEXT_THREADS", "1")
    args = ["run", "hi", "--model", str(tiny_llama), "--backend", "cpu", "--max-tokens", "2", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["threads"] == 1 and report["profile"]["threads"] == 1 and torch.get_num_threads() == 1
    result = runner.invoke(app, [*args, "--threads", "2"])  # the flag wins over the environment
    assert json.loads(result.stdout)["threads"] == 2 and torch.get_num_threads() == 2


def test_bad_thread_env_is_one_line_naming_the_field(tiny_llama, monkeypatch):
    monkeypatch.setenv("FLASHNEXT_THREADS", "0")
    result = runner.invoke(app, ["run", "hi", "--model", str(tiny_llama), "--backend", "cpu"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: profile setting 'threads'")


def test_backends_explain_says_how_many_threads_and_why():
    result = runner.invoke(app, ["backends", "--explain"])
    assert result.exit_code == 0
    line = [x for x in result.stdout.splitlines() if x.startswith("threads: ")]
    assert len(line) == 1 and "physical cores" in line[0] and "busy with other processes" in line[0]


def test_backends_table_keeps_every_precision_at_80_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    result = runner.invoke(app, ["backends"])
    assert result.exit_code == 0 and max(map(len, result.stdout.splitlines())) <= 80
    for precision in ("fp32", "bf16", "fp16", "fp8-e4m3", "fp8-e5m2", "int4"):
        assert precision in result.stdout
    assert "…" not in result.stdout


def test_run_prints_one_line_per_stage_when_not_a_terminal(tiny_llama):
    result = runner.invoke(app, ["run", "hi", "--model", str(tiny_llama), "--backend", "cpu", "--max-tokens", "2"])
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.splitlines()
    assert [line.split(":")[0] for line in lines[:3]] == ["loading model", "preparing weights for cpu", "warming up"]
    assert all(line.endswith(" s)") for line in lines[:3])


def test_int4_graph_build_is_warm_up_not_first_token(tiny_llama):
    """The CPU's onnxruntime graph is built in the warm-up, which counts its time; the request finds it ready."""
    from flashnext.core.llm import LLM

    llm = LLM(str(tiny_llama), backend="cpu", precision="int4", int4_route="onnxruntime")
    assert llm.engine.runner.graph is None
    seconds = llm.warm_up()
    graph = llm.engine.runner.graph
    assert graph is not None and llm.warm_up_s == pytest.approx(seconds, abs=1e-6) and seconds > 0
    llm.generate(["hello"])
    assert llm.engine.runner.graph is graph


def test_int4_expansion_is_warm_up_not_first_token(tiny_llama):
    """On the torch route the int4 → fp16 expansion happens in the warm-up: the kernels hold every expanded weight
    before the request, and warm_up_s is that time."""
    from flashnext.core.llm import LLM

    llm = LLM(str(tiny_llama), backend="cpu", precision="int4", int4_route="torch")
    kernels = llm.engine.model.kernels
    assert not kernels._expanded
    seconds = llm.warm_up()
    assert kernels._expanded and llm.warm_up_s == pytest.approx(seconds, abs=1e-6) and seconds > 0
    cached = dict(kernels._expanded)
    llm.generate(["hello"])
    assert kernels._expanded.keys() == cached.keys()  # nothing left to expand for the request


def _bench_two_batches(model, out, *extra: str):
    """`flashnext bench` on the tiny model at batch sizes 1 and 2, its rows written to `out`."""
    args = ["bench", "--model", str(model), "--backend", "cpu", "--batch-sizes", "1,2", "--prompt-len", "8"]
    return runner.invoke(app, [*args, "--gen-len", "4", "--json", str(out), *extra])


def test_bench_writes_valid_json_after_every_configuration(tiny_llama, tmp_path, monkeypatch):
    """A bench cut short (here: the second configuration fails) still leaves the rows measured so far, and each
    finished configuration prints its line."""
    from flashnext.core import cli_bench

    real, calls = cli_bench.time_generation, []

    def time_generation(llm, batch_size, *args, **kwargs):
        calls.append(batch_size)
        if batch_size == 2:
            raise RuntimeError("the machine went away")
        return real(llm, batch_size, *args, **kwargs)

    monkeypatch.setattr(cli_bench, "time_generation", time_generation)
    out = tmp_path / "bench.json"
    result = _bench_two_batches(tiny_llama, out)
    assert result.exit_code == 1 and "the machine went away" in result.stderr
    rows = json.loads(out.read_text())
    assert [r["batch_size"] for r in rows] == [1]
    assert rows[0]["warm_up_s"] > 0 and rows[0]["threads"] == torch.get_num_threads()
    assert "bench 1/2: batch 1: ttft" in result.stderr


def test_bench_rows_carry_warm_up_and_threads(tiny_llama, tmp_path):
    out = tmp_path / "bench.json"
    result = _bench_two_batches(tiny_llama, out, "--threads", "1")
    assert result.exit_code == 0, result.stderr
    rows = json.loads(out.read_text())
    assert [r["batch_size"] for r in rows] == [1, 2] and {r["threads"] for r in rows} == {1}
    assert all(r["warm_up_s"] > 0 for r in rows)
    assert [line.split(":")[0] for line in result.stderr.splitlines() if line.startswith("bench")] == [
        "bench 1/2",
        "bench 2/2",
    ]


def test_bench_json_folder_must_exist_before_the_run(tmp_path):
    result = runner.invoke(app, ["bench", "--shape", "smollm2-135m", "--json", str(tmp_path / "no" / "b.json")])
    assert result.exit_code == 2 and "does not exist" in result.stderr


def test_bench_shapes_run_the_precision_the_default_model_gets():
    from flashnext.core.cli_bench import default_precision

    assert default_precision("cpu", "smollm2-135m") == "int4"  # the embedded model's Q4_1 runs as int4 on the CPU
    assert default_precision("cpu", None) is None  # a checkpoint decides for itself


def test_serve_logs_everything_on_stderr():
    from flashnext.core.cli_serve import stderr_log_config

    handlers = stderr_log_config()["handlers"]
    assert {h["stream"] for h in handlers.values()} == {"ext://sys.stderr"}


def test_serve_refuses_a_missing_log_config(tmp_path):
    result = runner.invoke(app, ["serve", "--log-config", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "nope.yaml" in result.stderr


def test_user_errors_name_the_thread_field():
    from flashnext.core.profile import Profile

    with pytest.raises(UserError, match="threads"):
        Profile().overridden(threads=0)


def test_the_python_api_stays_quiet_after_a_command(tiny_llama, capsys):
    from flashnext.core.llm import LLM

    assert (
        runner.invoke(app, ["run", "hi", "--model", str(tiny_llama), "--backend", "cpu", "--max-tokens", "1"]).exit_code
        == 0
    )
    LLM(str(tiny_llama), backend="cpu").warm_up()
    assert capsys.readouterr().err == ""
