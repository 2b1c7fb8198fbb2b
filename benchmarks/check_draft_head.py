"""How often an fp8 copy of the LM head (spec_draft_head=fp8) picks another token than the 16-bit head, on real
hidden states: the embedded SmolLM2's final states over 1,024 tokens of Hamlet (teacher-forced), each read through
its bf16 head and through an fp8-e4m3 copy with a scale a row (fp8_quantize, as the CUDA drafter makes it).

A greedy draft read through the copy is accepted where the bf16 head's would be only if both heads pick the same
token: "kept_where_bf16_is_right" is the share of the positions where the bf16 head picks the text's next token
(where a draft would be accepted) at which the copy picks it too; the agreement over all positions and the
accuracy columns (the pick equals the text's next token) show the rest. The target's own states stand in for an
MTP module's output (the same space: the module's head is the target's).

    python benchmarks/check_draft_head.py [--json OUT]
"""

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fixtures import shakespeare_text  # noqa: E402
from flashnext.core.llm import LLM  # noqa: E402
from flashnext.core.loader import load_model  # noqa: E402
from flashnext.core.precision import fp8_quantize  # noqa: E402
from numerics import engine_outputs  # noqa: E402

PASSAGE_TOKENS = 1024


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)
    loaded = load_model(None)
    llm = LLM(loaded, backend="cpu", precision="bf16", max_num_seqs=1, max_model_len=PASSAGE_TOKENS + 64)
    text = shakespeare_text("hamlet_gut.txt")
    ids = llm.tokenizer.encode(text[text.index("ACT I.") :])[:PASSAGE_TOKENS]
    states = engine_outputs(llm, ids)[0][: len(ids)].float()  # final hidden states, after the last norm
    head = llm.engine.model.lm_head.to(torch.bfloat16)
    fp8 = fp8_quantize(head, "fp8-e4m3", per_channel=True)
    exact, rounded = head.float(), (fp8.data.float() * fp8.scale)
    x = states.bfloat16().float()
    logits = {"bf16": x @ exact.T, "fp8": x @ rounded.T}  # fp32 sums of the heads' exact products
    following = torch.tensor(ids[1:])
    out = {
        "model": "smollm2-135m (embedded), bf16",
        "positions": len(ids),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "fp8_copy_bytes": fp8.data.numel() + 4 * fp8.scale.numel(),
    }
    # As the kernels write them (bf16 logits, the first of equal maxima) and unrounded.
    for name, cast in (("bf16_logits", torch.bfloat16), ("fp32_logits", torch.float32)):
        picks = {head_name: v.to(cast).float().argmax(-1) for head_name, v in logits.items()}
        right = picks["bf16"][:-1] == following  # where a draft from this state would be accepted
        out[name] = {
            "agreement_fp8_vs_bf16": round(float((picks["fp8"] == picks["bf16"]).float().mean()), 4),
            "kept_where_bf16_is_right": round(
                float((picks["fp8"][:-1] == picks["bf16"][:-1])[right].float().mean()), 4
            ),
            **{
                f"next_token_accuracy_{k}": round(float((v[:-1] == following).float().mean()), 4)
                for k, v in picks.items()
            },
        }
    print(json.dumps(out, indent=2))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
