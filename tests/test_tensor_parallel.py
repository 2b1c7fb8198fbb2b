"""Tensor parallelism on the CPU through gloo: shards read from every format equal the whole model's slices, TP = 2
and 3 generate TP = 1's greedy tokens through the engine's batching, chunking, prefix caching and drafting, sizes
that do not split a model are refused before loading, and a rank that dies ends the group with one line."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
from typer.testing import CliRunner

from fixtures import write_tiny_gguf, write_tiny_hf_model
from flashnext.core.cli import app
from flashnext.core.cli_bench import SHAPES, bench_rows
from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.errors import UserError
from flashnext.core.llm import LLM
from flashnext.core.loader import load_model
from flashnext.core.precision import Int4Weight
from flashnext.core.sharding import Shard, ShardPlan, check_size, fitting_sizes, shard_loaded


def _same(a, b) -> bool:
    if isinstance(a, Int4Weight):
        return isinstance(b, Int4Weight) and torch.equal(a.dequantize(), b.dequantize())
    return torch.equal(a, b)


def _assert_shard_is_slice(shard, whole, plan: ShardPlan):
    expected = shard_loaded(whole, plan)
    assert shard.config == expected.config == plan.local_config()
    assert shard.weights.keys() == expected.weights.keys()
    for name, w in expected.weights.items():
        assert _same(shard.weights[name], w), name


def test_smollm2_splits_three_ways_not_two():
    config = SHAPES["smollm2-135m"]
    assert fitting_sizes(config) == [1, 3]
    check_size(config, 3, "smollm2")
    with pytest.raises(
        UserError, match=r"--tensor-parallel 2 does not split the model \(9 attention heads.* work for it: 1, 3"
    ):
        check_size(config, 2, "smollm2")


def test_kv_heads_replicate_when_fewer_than_ranks():
    config = SHAPES["smollm2-135m"].model_copy(update={"num_heads": 12, "num_kv_heads": 2})
    plans = [ShardPlan(config, rank, 4) for rank in range(4)]
    # Three query heads a rank; groups of six query heads share a KV head: ranks 0-1 read head 0, ranks 2-3 head 1.
    assert [p.first_kv_head for p in plans] == [0, 0, 1, 1]
    assert {p.local_config().num_kv_heads for p in plans} == {1}
    k_rows = [p.slice_of("model.layers.0.self_attn.k_proj.weight") for p in plans]
    assert k_rows == [(0, 0, 64), (0, 0, 64), (0, 64, 128), (0, 64, 128)]


@pytest.mark.parametrize("rank", [0, 1])
def test_safetensors_shard_reads_only_the_slices(tmp_path, rank):
    folder = write_tiny_hf_model(tmp_path / "m", arch="qwen2", shards=2, vocab_size=321)
    whole = load_model(str(folder))
    shard = load_model(str(folder), Shard(rank, 2))
    _assert_shard_is_slice(shard, whole, ShardPlan(whole.config, rank, 2))
    # An odd vocabulary: the last rank's rows are fewer.
    assert shard.weights["lm_head.weight"].shape[0] == (161 if rank == 0 else 160)


@pytest.mark.parametrize("cache", ["off", "on"])
def test_gguf_shard_slices_whole_quantized_blocks(tmp_path, monkeypatch, cache):
    monkeypatch.setenv("FLASHNEXT_CACHE_DIR", "off" if cache == "off" else str(tmp_path / "cache"))
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", arch="llama", qtype="Q4_0")
    whole = load_model(str(path))  # with the cache on, this writes the entry the shard then slices
    for rank in (0, 1):
        _assert_shard_is_slice(load_model(str(path), Shard(rank, 2)), whole, ShardPlan(whole.config, rank, 2))
    # Four ranks would cut the o projection's input into 16 columns a rank: half a Q4_0 block.
    with pytest.raises(UserError, match=r"(attn_output|o_proj).*cut (a block|its int4 groups)"):
        load_model(str(path), Shard(1, 4))


def _generate(llm, prompts, max_tokens=10):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    try:
        return [c.token_ids for c in llm.generate(prompts, params)], llm.engine
    finally:
        llm.close()


def test_tp2_runs_the_engine_as_tp1(tmp_path):
    """Several prompts of different lengths at once, prompts chunked 16 tokens a step, a shared prefix served from
    the cache, n-gram drafts verified: TP = 2's greedy tokens are TP = 1's. An odd vocabulary: the second rank's
    embedding and head slices are a row shorter."""
    tiny_llama = write_tiny_hf_model(tmp_path / "m", arch="llama", vocab_size=321)
    shared = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    prompts = [shared + [30, 31], [40, 41, 42] * 9, shared + [50], [3, 4]]
    settings = dict(
        backend="cpu",
        precision="fp32",
        profile="full",
        max_num_batched_tokens=16,
        chunked_prefill=True,
        prefix_caching=True,
        spec="ngram",
        block_size=4,
    )
    one, engine_one = _generate(LLM(model=str(tiny_llama), **settings), prompts, max_tokens=24)
    two, engine_two = _generate(LLM(model=str(tiny_llama), tensor_parallel=2, **settings), prompts, max_tokens=24)
    assert two == one
    assert engine_two.scheduler.prefill_chunks > 0 and engine_two.blocks.prefix_hits > 0
    assert engine_two.spec_stats()["drafted"] > 0
    assert engine_two.model.config.num_heads == engine_one.model.config.num_heads // 2


def test_tp2_bench_rows_on_random_weights(tiny_random):
    """Random weights made in memory (as `flashnext bench --shape`) are cut per rank; bf16 partial sums."""
    rows = bench_rows(tiny_random, "cpu", "bf16", None, [2], prompt_len=6, gen_len=3, tensor_parallel=2)
    assert rows[0]["tensor_parallel"] == 2 and rows[0]["decode_tok_s"] > 0


@pytest.mark.slow
def test_tp3_smollm2_matches_tp1():
    load_model(None)  # the converted copy the ranks read their slices from
    prompts = [[1, 504, 3125, 6354, 30], [1, 1782, 2, 314, 2683, 282, 260, 3125, 6354]]
    one, _ = _generate(LLM(backend="cpu"), prompts, max_tokens=8)
    three, engine = _generate(LLM(backend="cpu", tensor_parallel=3), prompts, max_tokens=8)
    assert three == one
    assert engine.model.config.num_heads == 3 and engine.model.config.num_kv_heads == 1


def test_refused_before_loading(tiny_llama):
    """4 heads do not split 3 ways: one line, exit 2, no rank started."""
    before = psutil.Process().children(recursive=True)
    res = CliRunner().invoke(
        app, ["run", "hi", "--backend", "cpu", "--model", str(tiny_llama), "--tensor-parallel", "3"]
    )
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [
        f"error: {tiny_llama}: --tensor-parallel 3 does not split the model (4 attention heads, 2 KV heads, "
        "128 MLP columns) evenly; sizes that work for it: 1, 2, 4"
    ]
    assert psutil.Process().children(recursive=True) == before


_FOREVER = """
import sys
from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.llm import LLM
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], backend="cpu", precision="fp32", tensor_parallel=2, threads=1)
    print("ready", flush=True)
    while True:
        llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=400, ignore_eos=True))
"""


def _start_forever(tmp_path, model) -> tuple[subprocess.Popen, psutil.Process]:
    script = tmp_path / "forever.py"
    script.write_text(textwrap.dedent(_FOREVER))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(model)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    time.sleep(0.5)  # inside the steps
    workers = [p for p in psutil.Process(proc.pid).children() if "python" in p.name().lower()]
    rank1 = [p for p in workers if "spawn_main" in " ".join(p.cmdline())]
    assert len(rank1) == 1, [p.cmdline() for p in workers]
    return proc, rank1[0]


@pytest.mark.slow
def test_killed_rank_ends_the_run_with_one_line(tiny_llama, tmp_path):
    proc, rank1 = _start_forever(tmp_path, tiny_llama)
    try:
        os.kill(rank1.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert err.strip().splitlines() == ["error: tensor-parallel rank 1 died (SIGKILL); the group is stopped"]


@pytest.mark.slow
def test_ranks_leave_when_rank0_dies(tiny_llama, tmp_path):
    proc, rank1 = _start_forever(tmp_path, tiny_llama)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        rank1.wait(timeout=30)  # psutil.TimeoutExpired if it lingers
    finally:
        proc.kill()
        if rank1.is_running():
            rank1.kill()


def _rank_errors(stderr: str) -> str:
    """The ranks' own error lines first: torchrun's closing summary names only the signal."""
    marks = ("terminate", "what()", "Error", "error", "Fatal", "Abort", "Exception")
    return "\n".join(line for line in stderr.splitlines() if any(m in line for m in marks))[-3000:] + stderr[-800:]


@pytest.mark.slow
def test_torchrun_ranks_join_its_group(tiny_llama):
    """Under torchrun every process runs the command; rank 0 alone prints, with one device's tokens."""
    command = ["run", "hello there", "--backend", "cpu", "--model", str(tiny_llama), "--max-tokens", "8", "--json"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "flashnext.core.cli"]
    res = subprocess.run(launcher + command + ["--tensor-parallel", "2"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, _rank_errors(res.stderr)
    one = CliRunner().invoke(app, command).output  # the progress lines, then the JSON
    assert json.loads(res.stdout)["token_ids"] == json.loads(one[one.index("{") :])["token_ids"]


def test_what_cannot_run_split_is_refused_first(tiny_llama, monkeypatch):
    from flashnext.core.parallel import start
    from flashnext.core.profile import Profile
    from flashnext.plugins.cpu import CpuBackend

    class OwnFormat(CpuBackend):
        def load_model(self, spec):
            raise AssertionError("refused before loading")

    cpu, model = CpuBackend(), str(tiny_llama)
    with pytest.raises(UserError, match="--spec mtp does not run tensor-parallel"):
        start(cpu, model, Profile(tensor_parallel=2, spec="mtp"), {})
    with pytest.raises(UserError, match="runs its own model format"):
        start(OwnFormat(), model, Profile(tensor_parallel=2), {})
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(UserError, match="torchrun started 4 processes but --tensor-parallel is 1"):
        start(cpu, model, Profile(), {})
    with pytest.raises(UserError, match=r"--tensor-parallel 2 but torchrun started 4 processes"):
        start(cpu, model, Profile(tensor_parallel=2), {})
