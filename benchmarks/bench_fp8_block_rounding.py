"""What rounding a block-scaled fp8 checkpoint again to a scale a row costs: the fp8 kernels take one scale a row,
so `--precision fp8-e4m3` (the CUDA default for fp8 checkpoints) rounds each block's values once more.

1. Weights of 2048 x 2048 normal or Student-t values, with and without row or column spreads: NMSE against the
   original values of 128 x 128 block fp8 (the checkpoint), of it rounded again to a scale a row (what runs), and
   of fp8 with a scale a row straight from the original (`--precision fp8-e4m3` on a 16-bit checkpoint).
2. The embedded SmolLM2 (its Q4_1 values as the original): every projection stored as 128 x 128 block fp8, then
   run on the CPU backend as its exact values (fp32) and rounded again (fp8-e4m3); Hamlet perplexity (passages
   scored apart) and greedy answers to a few chat prompts beside the original and per-row fp8 of it.

    python benchmarks/bench_fp8_block_rounding.py --passages 3 --tokens 512 --json fp8_block_rounding.json
"""

import argparse
import json
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_fp8_activation_scales import CHATS  # noqa: E402

from fixtures import shakespeare_text  # noqa: E402
from flashnext.core.cli_bench import machine_name  # noqa: E402
from flashnext.core.engine.sequence import SamplingParams  # noqa: E402
from flashnext.core.llm import LLM  # noqa: E402
from flashnext.core.loader import load_model  # noqa: E402
from flashnext.core.precision import Fp8Weight, block_multipliers, fp8_block_weight, fp8_quantize  # noqa: E402
from flashnext.plugins.cpu import CpuBackend  # noqa: E402
from numerics import engine_logits, perplexity  # noqa: E402

BLOCK = (128, 128)


def block_fp8(w: torch.Tensor, block=BLOCK) -> Fp8Weight:
    """w as a block-scaled fp8 checkpoint stores it: each block's largest magnitude onto e4m3's 448."""
    n, k = w.shape
    rows, cols = block
    padded = torch.zeros(-(-n // rows) * rows, -(-k // cols) * cols)
    padded[:n, :k] = w.float()
    amax = padded.reshape(padded.shape[0] // rows, rows, -1, cols).abs().amax(dim=(1, 3))
    multipliers = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    per_element = block_multipliers(multipliers, block, (n, k))
    return fp8_block_weight((w.float() / per_element).to(torch.float8_e4m3fn), multipliers, block)


def nmse(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float(((approx - exact) ** 2).sum() / (exact**2).sum())


def weight_rows(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    t3 = torch.distributions.StudentT(3.0)
    torch.manual_seed(seed)
    cases = {
        "normal": torch.randn(2048, 2048, generator=g),
        "student-t 3": t3.sample((2048, 2048)),
        "student-t 3, rows spread e^U(0,1)": t3.sample((2048, 2048)) * torch.rand(2048, 1, generator=g).exp(),
        "normal, columns spread e^U(0,3)": torch.randn(2048, 2048, generator=g)
        * (3 * torch.rand(1, 2048, generator=g)).exp(),
    }
    rows = []
    for name, w in cases.items():
        block = block_fp8(w)
        row = {
            "weights": name,
            "block fp8": nmse(block.dequantize(), w),
            "rounded again a row": nmse(fp8_quantize(block.dequantize()).dequantize(), w),
            "fp8 a row from the original": nmse(fp8_quantize(w).dequantize(), w),
        }
        rows.append(row)
        print(
            f"{name:36s} NMSE  block {row['block fp8']:.2e}  again a row {row['rounded again a row']:.2e}"
            f"  a row from the original {row['fp8 a row from the original']:.2e}",
            flush=True,
        )
    return rows


def text_rows(passages: int, tokens: int) -> list[dict]:
    loaded = load_model(None)
    original = {n: (w.dequantize() if "_proj." in n else w) for n, w in loaded.weights.items()}
    stored = {n: (block_fp8(w) if "_proj." in n else w) for n, w in original.items()}
    cases = {
        "original (Q4_1 values), fp32": (original, "fp32"),
        "block fp8 as its values, fp32": (stored, "fp32"),
        "block fp8 rounded again a row, fp8-e4m3": (stored, "fp8-e4m3"),
        "fp8 a row from the original, fp8-e4m3": (original, "fp8-e4m3"),
    }
    text = shakespeare_text("hamlet_gut.txt")
    ids = loaded.tokenizer.encode(text[text.index("ACT I.") :])
    rows = []
    for case, (weights, precision) in cases.items():
        llm = LLM(
            replace(loaded, weights=weights),
            backend="cpu",
            precision=precision,
            max_num_seqs=4,
            max_model_len=tokens + 64,
        )
        answers = [c.text for c in llm.generate(CHATS, SamplingParams(max_tokens=16), chat=True)]
        ppl = [
            perplexity(engine_logits(llm, ids[i * tokens : (i + 1) * tokens]), ids[i * tokens : (i + 1) * tokens])
            for i in range(passages)
        ]
        rows.append({"case": case, "perplexity": ppl, "answers": answers, "tokens_a_passage": tokens})
        print(f"{case:42s} perplexity {' '.join(f'{x:.3f}' for x in ppl)}  {answers[0]!r}", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", dest="json_path")
    p.add_argument("--tokens", type=int, default=512, help="tokens a passage")
    p.add_argument("--passages", type=int, default=1, help="consecutive passages of Hamlet, each scored apart")
    args = p.parse_args(argv)
    result = {
        "weights": weight_rows(),
        "text": text_rows(args.passages, args.tokens),
        "machine": machine_name(CpuBackend()),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
    }
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
