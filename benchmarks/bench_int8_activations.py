"""What rounding the activations to int8 costs in text quality on the embedded SmolLM2 (int4 weights): in blocks of
32 columns (the CUDA int4 GEMV's, llama.cpp's q8_1) or in groups of 64 or 128 (the CUDA W4A8 skinny GEMM's
Int8Rows take the weight's group; 576-column rows end in a partial group of 64 at 128).

Perplexity over passages of Hamlet (teacher-forced, each scored apart) and greedy answers to a few chat prompts.
The CPU backend's linear is wrapped so that each int4 projection first rounds its input to int8 a block at a time
(scale: the block's largest magnitude / 127) and then multiplies the dequantized weight in fp32.

    python benchmarks/bench_int8_activations.py --passages 3 --tokens 512 --json int8_activations.json
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8_activation_scales import rounded_input_linear, score_cases  # noqa: E402

from flashnext.core.precision import Int4Weight  # noqa: E402

# case -> columns a block of x rounds to int8 over (None: 16-bit activations, what the CPU backend computes)
CASES = {"16-bit activations": None, "int8 a block of 32": 32, "int8 a block of 64": 64, "int8 a block of 128": 128}


def int8_round_trip(x: torch.Tensor, block: int) -> torch.Tensor:
    """x rounded to int8 a block of columns at a time (the last block may be partial), back in fp32: the kernels'
    rounding, floor(x * 127 / amax + 0.5) * amax / 127."""
    pieces = []
    for piece in x.float().split(block, dim=-1):
        amax = piece.abs().amax(-1, keepdim=True)
        pieces.append(torch.floor(piece * (127.0 / amax.clamp_min(1e-30)) + 0.5) * (amax / 127.0))
    return torch.cat(pieces, dim=-1)


def case_linear(case: str, model):
    """The wrapped linear of a case (None: the CPU backend's own): int4 projections see x rounded a block at a time."""
    block = CASES[case]
    return rounded_input_linear(Int4Weight, lambda x, w: int8_round_trip(x, block)) if block else None


def main(argv=None):
    score_cases(argv, __doc__.splitlines()[0], "int4", list(CASES), case_linear)


if __name__ == "__main__":
    main()
