"""What the fp8 activation scales cost in text quality on the embedded SmolLM2: per token, or grouped as the CUDA
backend's decode steps group them (the o projection's input per kv group or head, the down projection's per
1,024 columns; the norms' outputs per token).

Perplexity over passages of Hamlet (teacher-forced, each scored apart) and greedy answers to a few chat prompts,
with fp8-e4m3 weights and: 16-bit activations (what the CPU backend computes), activations quantized per token,
grouped as CUDA groups them (and each of its two groupings alone), and in 1 x 128 blocks everywhere. The CPU
backend's linear is wrapped so that each fp8 projection first rounds its input through fp8 with those scales and
then multiplies in fp32, the products the fp8 tensor cores sum.

    python benchmarks/bench_fp8_activation_scales.py --passages 3 --tokens 512 --json fp8_activation_scales.json
"""

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fixtures import shakespeare_text  # noqa: E402
from flashnext.core.cli_bench import machine_name  # noqa: E402
from flashnext.core.engine.sequence import SamplingParams  # noqa: E402
from flashnext.core.llm import LLM  # noqa: E402
from flashnext.core.loader import load_model  # noqa: E402
from flashnext.core.precision import Fp8Weight, fp8_quantize_per_token  # noqa: E402
from flashnext.plugins.cpu.kernels import CpuKernels  # noqa: E402
from flashnext.plugins.cuda.launch import heads_per_scale, silu_fp8_group  # noqa: E402
from numerics import engine_logits, perplexity  # noqa: E402

PASSAGE_TOKENS = 1024
CHATS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in the solar system?",
    "Translate 'good morning' to French.",
]
CASES = [
    "16-bit activations",
    "per token",
    "o input grouped only",
    "down input grouped only",
    "grouped as CUDA decode steps",
    "1 x 128 blocks everywhere",
]


def fp8_round_trip(x: torch.Tensor, group: int) -> torch.Tensor:
    """x through fp8-e4m3 with a scale per row and group of columns (the last group may be partial), in fp32."""
    pieces = []
    for piece in x.float().split(group, dim=-1):
        data, scale = fp8_quantize_per_token(piece)
        pieces.append(data.float() * scale)
    return torch.cat(pieces, dim=-1)


def rounded_input_linear(weight_type: type, round_x):
    """CpuKernels.linear whose weights of weight_type first see their input as round_x(x, w) (fp32), then multiply
    in fp32, the products the quantized kernels sum; other weights run as the backend runs them."""

    def linear(self, x, w, bias=None):
        if not isinstance(w, weight_type):
            return CpuKernels_linear(self, x, w, bias)
        out = F.linear(round_x(x, w), w.dequantize(torch.float32)).to(x.dtype)
        return out if bias is None else out + bias.to(x.dtype)

    return linear


def quantizing_linear(groups: dict[int, int], default: int | None = None):
    """CpuKernels.linear with fp8 inputs: groups maps id(weight) to its group width; other weights take default
    (None: per token)."""
    return rounded_input_linear(Fp8Weight, lambda x, w: fp8_round_trip(x, groups.get(id(w), default or x.shape[-1])))


CpuKernels_linear = CpuKernels.linear


def cuda_groups(model, o: bool = True, down: bool = True) -> dict[int, int]:
    cfg = model.config
    group = heads_per_scale(cfg.num_heads // cfg.num_kv_heads) * cfg.head_dim
    out = {}
    for layer in model.layers:
        if o:
            out[id(layer.o)] = group
        if down:
            out[id(layer.down)] = silu_fp8_group(layer.down.shape[1])
    return out


def case_linear(case: str, model):
    """The wrapped linear of a case (None: the CPU backend's own, 16-bit activations)."""
    if case == "16-bit activations":
        return None
    groups = {
        "o input grouped only": cuda_groups(model, down=False),
        "down input grouped only": cuda_groups(model, o=False),
        "grouped as CUDA decode steps": cuda_groups(model),
    }.get(case, {})
    return quantizing_linear(groups, 128 if case == "1 x 128 blocks everywhere" else None)


def score_cases(argv, description: str, precision: str, cases: list[str], linear_of) -> list[dict]:
    """Each case's Hamlet perplexities and chat answers on the CPU backend at precision, CpuKernels.linear replaced
    by linear_of(case, model) (None: the backend's own); --json writes the rows."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", dest="json_path")
    p.add_argument("--tokens", type=int, default=PASSAGE_TOKENS, help="tokens a passage")
    p.add_argument("--passages", type=int, default=1, help="consecutive passages of Hamlet, each scored apart")
    args = p.parse_args(argv)
    loaded = load_model(None)
    text = shakespeare_text("hamlet_gut.txt")
    ids = loaded.tokenizer.encode(text[text.index("ACT I.") :])
    passages = [ids[i * args.tokens : (i + 1) * args.tokens] for i in range(args.passages)]
    rows = []
    for case in cases:
        llm = LLM(loaded, backend="cpu", precision=precision, max_num_seqs=4, max_model_len=args.tokens + 64)
        model = llm.engine.model
        CpuKernels.linear = linear_of(case, model) or CpuKernels_linear
        try:
            answers = [c.text for c in llm.generate(CHATS, SamplingParams(max_tokens=16), chat=True)]
            ppl = [perplexity(engine_logits(llm, passage), passage) for passage in passages]
        finally:
            CpuKernels.linear = CpuKernels_linear
        rows.append(
            {
                "case": case,
                "perplexity": ppl,
                "answers": answers,
                "machine": machine_name(llm.engine.backend),
                "tokens_a_passage": args.tokens,
                "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
            }
        )
        print(f"{case:30s} perplexity {' '.join(f'{x:.3f}' for x in ppl)}  {answers[0]!r}", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=2) + "\n")
    return rows


def main(argv=None):
    score_cases(argv, __doc__.splitlines()[0], "fp8-e4m3", CASES, case_linear)


if __name__ == "__main__":
    main()
