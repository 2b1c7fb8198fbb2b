"""What keeping the LM head in fp8 costs in text quality on the embedded SmolLM2 (quantize_lm_head).

Perplexity over 1,024 tokens of Hamlet (teacher-forced) and greedy answers to a few chat prompts, for fp32, bf16,
fp8-e4m3 weights with a 16-bit head and the same with the head in fp8, int4 weights with a 16-bit head and the same
with the head in fp8 (Precision.head: an int4 head cost 15% perplexity, docs/benchmarks.md). On a backend that
cannot store a quantized head (the CPU one: its products expand weights anyway) a subclass lets it, so the head's
rounding is measured apart from any kernel.

    python benchmarks/bench_lm_head_quality.py --json head_quality.json      # the CPU backend
"""

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fixtures import shakespeare_text  # noqa: E402
from flashnext.core.cli_bench import machine_name  # noqa: E402
from flashnext.core.engine.sequence import SamplingParams  # noqa: E402
from flashnext.core.llm import LLM  # noqa: E402
from flashnext.core.loader import load_model  # noqa: E402
from flashnext.plugins.cpu import CpuBackend  # noqa: E402
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
    ("fp32", "fp32", False),
    ("bf16", "bf16", False),
    ("fp8 weights", "fp8-e4m3", False),
    ("fp8 weights + fp8 head", "fp8-e4m3", True),
    ("int4 weights", "int4", False),
    ("int4 weights + fp8 head", "int4", True),
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)
    CpuBackend.quantized_head = lambda self, precision: True  # see the module docstring
    loaded = load_model(None)
    text = shakespeare_text("hamlet_gut.txt")
    rows = []
    for label, precision, quantized_head in CASES:
        llm = LLM(
            loaded,
            backend="cpu",
            precision=precision,
            max_num_seqs=4,
            max_model_len=PASSAGE_TOKENS + 64,
            quantize_lm_head=quantized_head,
        )
        ids = llm.tokenizer.encode(text[text.index("ACT I.") :])[:PASSAGE_TOKENS]
        answers = [c.text for c in llm.generate(CHATS, SamplingParams(max_tokens=16), chat=True)]
        rows.append(
            {
                "case": label,
                "perplexity": perplexity(engine_logits(llm, ids), ids),
                "answers": answers,
                "head": type(llm.engine.model.lm_head).__name__,
                "machine": machine_name(llm.engine.backend),
                "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
            }
        )
        print(f"{label:24s} perplexity {rows[-1]['perplexity']:.3f}  {answers[0]!r}", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
