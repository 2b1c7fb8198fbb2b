"""CPU prefill and decode tok/s of the default model: flashnext (fp32, int4) next to HF transformers, same run.

transformers runs LlamaForCausalLM in fp32 on exactly our dequantized weights, on the same torch and thread count,
with `generate` (greedy, a fixed token count, KV cache on, `torch.inference_mode`). flashnext runs through
`LLM` / `LLMEngine` as a user would. One request at a time (batch 1): prefill tok/s = prompt tokens / time to the
first token; decode tok/s = (gen tokens - 1) / time from the first to the last token. The three engines take turns
within each repetition so background load hits them alike; the median repetition is reported.

    python benchmarks/bench_cpu_vs_hf.py --json bench_cpu_vs_hf.json
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.table import Table
from safetensors.torch import save_file

from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.llm import LLM
from flashnext.core.loader import load_model

# Plain English prose, so both models see realistic token statistics; repeated to reach any --prompt-len.
PROSE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a screw press adapted from winemaking. Before his workshop in Mainz, books were "
    "copied by hand, a slow and costly process. Within fifty years presses were running in more than two hundred "
    "cities, prices fell, literacy spread, and ideas travelled faster than ever before. "
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Llama-family model path (default: the embedded SmolLM2-135M Q4_1 GGUF)")
    p.add_argument("--precisions", default="fp32,int4", help="flashnext precisions to run, comma-separated")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    p.add_argument("--json", dest="json_path", help="write the rows (a list of objects) here")
    return p.parse_args(argv)


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine())
    return {"host": platform.node(), "cpu": cpu, "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "flashnext": version("flashnext"), "python": platform.python_version()}


def hf_llama(loaded, folder: Path):
    """LlamaForCausalLM holding our dequantized weights (our canonical names are HF's), loaded the usual way."""
    c = loaded.config
    if c.architecture != "llama" or c.rope_scaling is not None:
        raise SystemExit(f"this benchmark compares against LlamaForCausalLM; {loaded.source} is not a plain Llama")
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=None, pad_token_id=0,
    )
    state = {k: (w if isinstance(w, torch.Tensor) else w.dequantize(torch.float32)).float().contiguous()
             for k, w in loaded.weights.items()}
    config.save_pretrained(folder)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly --gen-len tokens, like ignore_eos on our side
    model.generation_config.pad_token_id = 0
    return model


class TokenClock(transformers.StoppingCriteria):
    """Called by `generate` after every new token: records when it came, never stops anything."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def run_hf(model, ids: list[int], gen_len: int) -> tuple[float, list[float], list[int]]:
    clock = TokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=gen_len,
                             stopping_criteria=transformers.StoppingCriteriaList([clock]))
    return start, clock.times, out[0, len(ids):].tolist()


def run_ours(llm: LLM, ids: list[int], gen_len: int) -> tuple[float, list[float], list[int]]:
    engine = llm.engine
    start = time.perf_counter()
    seq = engine.add_request(ids, SamplingParams(max_tokens=gen_len, ignore_eos=True))
    times = []
    while engine.has_work():
        if any(out.new_token_ids for out in engine.step()):
            times.append(time.perf_counter())
    return start, times, seq.output_ids


def rates(start: float, times: list[float], prompt_len: int) -> dict:
    ttft = times[0] - start
    return {"ttft_s": ttft, "prefill_tok_s": prompt_len / ttft,
            "decode_tok_s": (len(times) - 1) / (times[-1] - times[0])}


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    loaded = load_model(args.model)
    ids = loaded.tokenizer.encode(PROSE * (1 + args.prompt_len // 40))[: args.prompt_len]
    # Every repetition sends the same prompt: with the prefix cache on, ours would skip the prefill it measures.
    settings = dict(backend="cpu", max_num_seqs=1, max_model_len=args.prompt_len + args.gen_len + 16,
                    prefix_caching=False)
    runners = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf_model = hf_llama(loaded, Path(tmp))
        runners[("transformers", "fp32")] = lambda: run_hf(hf_model, ids, args.gen_len)
        for precision in args.precisions.split(","):
            llm = LLM(loaded, precision=precision, **settings)
            runners[("flashnext", precision)] = lambda llm=llm: run_ours(llm, ids, args.gen_len)
        samples = {key: [] for key in runners}
        outputs = {}
        for key, run in runners.items():  # warm-up: one-time conversions, allocator, thread pools
            outputs[key] = run()[2]
        for rep in range(args.repeats):
            for key, run in runners.items():
                start, times, _ = run()
                samples[key].append(rates(start, times, len(ids)))
                console.log(f"rep {rep + 1}/{args.repeats} {key[0]} {key[1]}: "
                            f"decode {samples[key][-1]['decode_tok_s']:.1f} tok/s")
    rows = summarize(samples, outputs, args, len(ids))
    print_table(rows)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=2))
    return rows


def summarize(samples: dict, outputs: dict, args, prompt_len: int) -> list[dict]:
    hf_key = ("transformers", "fp32")
    base = {"machine": machine(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": args.model or "SmolLM2-135M-Instruct.Q4_1.gguf (embedded)", "backend": "cpu", "batch_size": 1,
            "prompt_len": prompt_len, "gen_len": args.gen_len, "repeats": args.repeats}
    medians = {key: {m: statistics.median(s[m] for s in runs) for m in runs[0]} for key, runs in samples.items()}
    rows = []
    for (engine, precision), med in medians.items():
        row = base | {"engine": engine, "precision": precision} | med
        row["prefill_vs_hf"] = med["prefill_tok_s"] / medians[hf_key]["prefill_tok_s"]
        row["decode_vs_hf"] = med["decode_tok_s"] / medians[hf_key]["decode_tok_s"]
        row["same_tokens_as_hf"] = outputs[(engine, precision)] == outputs[hf_key]
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    m = rows[0]["machine"]
    table = Table(title=f"prompt {rows[0]['prompt_len']} + gen {rows[0]['gen_len']} tokens, batch 1 · "
                        f"{m['cpu']}, {m['torch_threads']} threads, torch {m['torch']}")
    for col in ("engine", "precision", "prefill tok/s", "decode tok/s", "prefill ×HF", "decode ×HF", "same tokens"):
        table.add_column(col, justify="left" if col in ("engine", "precision") else "right")
    for r in rows:
        table.add_row(r["engine"], r["precision"], f"{r['prefill_tok_s']:.1f}", f"{r['decode_tok_s']:.1f}",
                      f"{r['prefill_vs_hf']:.2f}", f"{r['decode_vs_hf']:.2f}", "yes" if r["same_tokens_as_hf"] else "no")
    Console().print(table)


if __name__ == "__main__":
    main()
