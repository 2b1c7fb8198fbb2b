"""The CPU kernels where they leave the reference's code: same results."""

import torch

from flashnext.core.kernels import ReferenceKernels, SamplingTensors
from flashnext.plugins.cpu.kernels import CpuKernels


def test_cpu_greedy_sampling_picks_what_the_reference_picks():
    """The CPU kernels' greedy argmax (numpy's) against the reference's (torch's): the first of tied largest logits,
    a NaN before any number; sampled rows still go the reference's way."""
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    logits[1, [7, 500]] = 50.0  # a tie: the first wins
    logits[2, 900] = float("nan")
    logits[3, :] = -float("inf")
    greedy = SamplingTensors(torch.zeros(4), torch.zeros(4, dtype=torch.long), torch.ones(4), torch.arange(4), True)
    got, want = CpuKernels().sample(logits, greedy), ReferenceKernels().sample(logits, greedy)
    assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want)
    assert got[1] == 7 and got[2] == 900 and got[3] == 0
    hot = SamplingTensors(torch.full((2,), 0.8), torch.zeros(2, dtype=torch.long), torch.ones(2), torch.arange(2))
    assert torch.equal(CpuKernels().sample(logits[:2], hot), ReferenceKernels().sample(logits[:2], hot))
