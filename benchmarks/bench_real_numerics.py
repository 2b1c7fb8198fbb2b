"""Real-weight numerics of the quantized precisions against bf16 on one backend (the embedded SmolLM2 by default).

Per precision: logits NMSE (‖ours − bf16‖² / ‖bf16‖² over every prompt position) on the numerics tests' prompts,
and greedy agreement with bf16 over 32 generated tokens (common prefix and matching positions).

    python benchmarks/bench_real_numerics.py --backend cuda --json numerics_h200.json
"""

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from flashnext.core.cli_bench import machine_name  # noqa: E402
from flashnext.core.engine.sequence import SamplingParams  # noqa: E402
from flashnext.core.llm import LLM  # noqa: E402
from flashnext.core.loader import load_model  # noqa: E402
from numerics import SMOLLM_PROMPTS, engine_logits  # noqa: E402


def measure(loaded, backend: str, precision: str) -> tuple[list[torch.Tensor], list[list[int]], str]:
    llm = LLM(model=loaded, backend=backend, precision=precision, profile="full")
    prompts = [llm.encode(text, chat=chat) for text, chat in SMOLLM_PROMPTS]
    logits = [engine_logits(llm, ids).cpu() for ids in prompts]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    greedy = [s.output_ids for s in llm.engine.generate(prompts, params)]
    return logits, greedy, machine_name(llm.engine.backend)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto")
    p.add_argument("--model", help="model path or HF id (default: the embedded SmolLM2-135M)")
    p.add_argument("--precisions", default="fp8-e4m3,int4")
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)
    loaded = load_model(args.model)
    ref_logits, ref_greedy, machine = measure(loaded, args.backend, "bf16")
    rows = []
    for precision in args.precisions.split(","):
        logits, greedy, _ = measure(loaded, args.backend, precision)
        err = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(logits, ref_logits))
        nmse = err / sum(float(b.double().pow(2).sum()) for b in ref_logits)
        rows.append(
            {
                "precision": precision,
                "reference": "bf16",
                "logits_nmse": nmse,
                "greedy_common_prefix": [common_prefix(g, r) for g, r in zip(greedy, ref_greedy)],
                "greedy_match": round(
                    sum(x == y for g, r in zip(greedy, ref_greedy) for x, y in zip(g, r))
                    / sum(len(r) for r in ref_greedy),
                    4,
                ),
            }
        )
        print(
            f"{precision:10s} NMSE {nmse:.3e}  greedy common prefix {rows[-1]['greedy_common_prefix']}"
            f"  match {rows[-1]['greedy_match']:.3f}"
        )
    common = {
        "machine": machine,
        "backend": args.backend,
        "model": args.model or "SmolLM2-135M-Instruct Q4_1",
        "prompts": len(SMOLLM_PROMPTS),
        "greedy_tokens": 32,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump([common | r for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
