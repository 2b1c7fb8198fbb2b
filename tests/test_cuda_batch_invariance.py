"""CUDA profile batch_invariant: a sequence's logits do not depend on the rows that share its steps.

At a tiny shape on the CPU through Triton's interpreter, the runner's eager steps take one kernel route and tile
configuration for any row count; on a GPU, the engine with graphs on the Qwen3-0.6B shape gives the same greedy
tokens alone and in batches.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is a test dependency (pip install triton)")

import flashnext.plugins.cuda.launch as launch  # noqa: E402
from flashnext.core.engine.runner import RunnerSetup  # noqa: E402
from flashnext.core.engine.scheduler import ScheduledSeq  # noqa: E402
from flashnext.core.engine.sequence import SamplingParams, Sequence  # noqa: E402
from flashnext.core.kernels import ReferenceKernels  # noqa: E402
from flashnext.core.model import DecoderModel  # noqa: E402
from flashnext.core.precision import PRECISIONS  # noqa: E402
from flashnext.core.profile import Profile  # noqa: E402
from flashnext.plugins.cuda.kernels import CudaKernels  # noqa: E402
from flashnext.plugins.cuda.runner import CudaGraphRunner  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = 4


class Steps:
    """Hand-scheduled steps over one runner: each sequence gets its own blocks; logits kept per sequence."""

    def __init__(self, loaded, precision: str):
        model = DecoderModel(loaded.config, loaded.weights, CudaKernels(), PRECISIONS[precision], DEV, torch.bfloat16)
        profile = Profile(name="basic", batch_invariant=True)
        self.runner = CudaGraphRunner.for_profile(profile)(model, RunnerSetup(96, BLOCK, torch.bfloat16))
        self.logits: dict[int, list[torch.Tensor]] = {}
        self.next_block = 0

    def add(self, prompt: list[int]) -> Sequence:
        seq = Sequence(list(prompt), SamplingParams(max_tokens=8))
        seq.block_table = list(range(self.next_block, self.next_block + 10))
        self.next_block += 10
        self.logits[id(seq)] = []
        return seq

    def step(self, work: list[tuple[Sequence, int]]) -> None:
        """work: (sequence, tokens this step); a sequence whose prompt is then whole gets logits and a token."""
        batch = []
        for seq, n in work:
            done = seq.num_computed + n >= len(seq)
            batch.append(ScheduledSeq(seq, n, 1 if done else 0))
        logits, _ = self.runner.run(batch)
        row = 0
        for item in batch:
            item.seq.num_computed += item.num_tokens
            if item.num_logits:
                self.logits[id(item.seq)].append(logits[row].float().cpu())
                item.seq.token_ids.append(int(logits[row].argmax()))
                row += 1


@pytest.mark.slow  # Triton's interpreter: about a minute on 2 busy cores
def test_the_option_takes_one_route_for_every_row_count(tiny_random, monkeypatch):
    """Prefill chunks and decode rows of 1 to 17 rows: every projection through the skinny GEMM (16-row tiles),
    never the register GEMV or cuBLAS, and attention with one tile configuration. (Under the interpreter both
    routes give the same sums, so the GPU test below is the one that compares tokens.)"""
    routes, attention_configs = [], []
    paged_config = launch.paged_config
    monkeypatch.setattr(
        launch,
        "paged_config",
        lambda dim, e5m2, decode: attention_configs.append(decode) or paged_config(dim, e5m2, decode),
    )
    torch_linear = ReferenceKernels.linear  # CudaKernels' cuBLAS route
    monkeypatch.setattr(ReferenceKernels, "linear", lambda *a, **k: routes.append("cublas") or torch_linear(*a, **k))
    for name in ("gemv", "skinny_gemm"):
        original = getattr(CudaKernels, name)

        def spy(self, x, w, *args, _name=name, _original=original, **kwargs):
            routes.append(_name)
            return _original(self, x, w, *args, **kwargs)

        monkeypatch.setattr(CudaKernels, name, spy)
    steps = Steps(tiny_random, "bf16")
    seqs = [steps.add(range(10 * i + 1, 10 * i + 1 + n)) for i, n in enumerate((1, 3, 17))]
    steps.step([(s, len(s)) for s in seqs])
    steps.step([(s, 1) for s in seqs[:1]])
    assert routes and set(routes) == {"skinny_gemm"}
    assert attention_configs and not any(attention_configs)
    k = steps.runner.kernels
    assert k.batch_invariant and k.row_invariant and k.decode_splits == 1 and k.gemv_max_rows == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_greedy_tokens_do_not_depend_on_the_batch_on_the_gpu():
    """Qwen3-0.6B's shape, random weights, CUDA graphs on: a prompt alone and at a random place in batches of 1-64
    mixed prompts (some chunked) gives the same greedy tokens; with requests joining mid-decode too."""
    from flashnext.core.cli_bench import random_model
    from flashnext.core.llm import LLM

    loaded = random_model("qwen3-0.6b", torch.device("cpu"))
    llm = LLM(
        model=loaded,
        backend="cuda",
        precision="bf16",
        batch_invariant=True,
        max_num_seqs=64,
        max_num_batched_tokens=256,
        max_model_len=2048,
    )
    engine, rng = llm.engine, random.Random(0)
    prompts = [[rng.randrange(100, 150_000) for _ in range(rng.choice((3, 17, 60, 300, 700)))] for _ in range(64)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    probes = [prompts[0], max(prompts, key=len)]
    alone = [engine.generate([p], params)[0].output_ids for p in probes]
    for size in (1, 2, 7, 16, 33, 64):
        for probe, want in zip(probes, alone):
            batch = [p for p in prompts if p is not probe][: size - 1]
            at = rng.randrange(size)
            batch.insert(at, probe)
            assert engine.generate(batch, params)[at].output_ids == want, f"batch {size}, probe at {at}"
    others = [engine.add_request(p, params) for p in prompts[1:20]]
    for _ in range(5):
        engine.step()
    late = [engine.add_request(p, params) for p in probes]
    while engine.has_work():
        engine.step()
    assert all(s.finish_reason == "length" for s in others)
    assert [s.output_ids for s in late] == alone
