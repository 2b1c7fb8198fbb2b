"""The CUDA forward pass split across two ranks (gloo on the CPU, Triton interpreter): the all-reduces that replace
linear_into's fused epilogues, the vocabulary-parallel embedding, the gathered logits and the greedy tokens picked
from each rank's best candidate give the one-rank pass's numbers."""

import os
import socket

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is a test dependency (pip install triton)")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from flashnext.core.engine.runner import RunnerSetup, StepInput  # noqa: E402
from flashnext.core.engine.scheduler import ScheduledSeq  # noqa: E402
from flashnext.core.engine.sequence import SamplingParams, Sequence  # noqa: E402
from flashnext.core.model import DecoderModel  # noqa: E402
from flashnext.core.parallel import TensorParallel  # noqa: E402
from flashnext.core.precision import PRECISIONS  # noqa: E402
from flashnext.core.profile import Profile  # noqa: E402
from flashnext.core.sharding import ShardPlan, shard_loaded  # noqa: E402
from flashnext.plugins.cuda.forward import forward_unnormed, greedy_keys_of, logits_of  # noqa: E402
from flashnext.plugins.cuda.kernels import CudaKernels  # noqa: E402
from flashnext.plugins.cuda.launch import argmax_chunks  # noqa: E402
from flashnext.plugins.cuda.runner import CudaGraphRunner  # noqa: E402

CPU = torch.device("cpu")


def _steps(model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill of two prompts through the eager runner (model.compute_logits: gathered on rank 0), then a decode
    step through the graphs' forward functions: (prefill logits, decode logits, decode greedy output)."""
    runner = CudaGraphRunner.for_profile(Profile(name="basic"))(model, RunnerSetup(16, 4, torch.float32))
    batch = []
    for i, prompt in enumerate((list(range(5, 25)), list(range(30, 37)))):
        seq = Sequence(prompt, SamplingParams())
        seq.block_table = list(range(8 * i, 8 * i + 8))
        batch.append(ScheduledSeq(seq, len(prompt), 1))
    prefill = runner.step(StepInput(batch)).logits
    for item in batch:
        item.seq.num_computed = len(item.seq)
        item.seq.token_ids.append(3)
    step = runner.prepare([ScheduledSeq(item.seq, 1, 1) for item in batch])
    k = model.kernels
    hidden, residual = forward_unnormed(model, k, step.input_ids, step.positions, step.meta, runner.kv_caches)
    decode = logits_of(model, k, hidden, residual).float()
    keys = torch.zeros(2, argmax_chunks(model.config.vocab_size), dtype=torch.int64)
    return prefill, decode, greedy_keys_of(model, k, hidden, residual, keys)


def _model(loaded) -> DecoderModel:
    return DecoderModel(loaded.config, loaded.weights, CudaKernels(), PRECISIONS["fp32"], CPU, torch.float32)


def _rank(rank: int, size: int, port: int, loaded, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        plan = ShardPlan(loaded.config, rank, size)
        model = _model(shard_loaded(loaded, plan))
        TensorParallel(rank, size, plan, "gloo").attach(model)
        result = _steps(model)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_cuda_forward_split_two_ways_matches_one(tiny_random, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank, args=(2, port, tiny_random, str(out)), nprocs=2)
    prefill, decode, greedy = torch.load(out)
    ref_prefill, ref_decode, _ = _steps(_model(tiny_random))
    for ours, ref in ((prefill, ref_prefill), (decode, ref_decode)):
        assert float((ours - ref).pow(2).sum() / ref.pow(2).sum()) < 1e-8
    assert greedy.dim() == 1 and torch.equal(greedy, decode.argmax(-1))
    assert torch.equal(greedy, ref_decode.argmax(-1))
