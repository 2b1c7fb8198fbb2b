"""CPU prefill and decode tok/s of the default model: flashnext next to llama.cpp and HF transformers, same run.

llama.cpp (through llama-cpp-python, where installed; the table records its version and build flags) runs the same
GGUF file. transformers runs LlamaForCausalLM in fp32 on exactly our dequantized weights, on the same torch and
thread count, with `generate` (greedy, KV cache on, `torch.inference_mode`). flashnext runs through `LLM` /
`LLMEngine` as a user would. One request at a time (batch 1), greedy, a fixed number of new tokens, the same token
ids for every engine: prefill tok/s = prompt tokens / time to the first token; decode tok/s = (new tokens - 1) /
time from the first to the last token. For each prompt length the engines take turns within each repetition, so
background load hits them alike; the median repetition is reported, with each engine's ratio to llama.cpp. Peak RSS
is measured per engine in a child process that loads the model and runs the longest prompt once.

    python benchmarks/bench_cpu_vs_hf.py                       # 32- and 1000-token prompts, 128 new tokens
    python benchmarks/bench_cpu_vs_hf.py --engines flashnext,llama.cpp --threads 2 --json out.json
    python benchmarks/bench_cpu_vs_hf.py --engines flashnext,llama.cpp --precisions int4,int4:onnxruntime-mlp-int8
"""

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.llm import LLM
from flashnext.core.loader import default_model_path, load_model

RESULTS = Path(__file__).parent / "results" / "cpu_vs_llamacpp.json"
ENGINES = ("flashnext", "llama.cpp", "transformers")

# Plain English prose, so every model sees realistic token statistics; repeated to reach any prompt length.
PROSE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a screw press adapted from winemaking. Before his workshop in Mainz, books were "
    "copied by hand, a slow and costly process. Within fifty years presses were running in more than two hundred "
    "cities, prices fell, literacy spread, and ideas travelled faster than ever before. "
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        help="a Llama-family model (default: the embedded SmolLM2-135M Q4_1 GGUF); llama.cpp needs a .gguf file",
    )
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, from: " + ", ".join(ENGINES))
    p.add_argument(
        "--precisions",
        default="int4",
        help="flashnext precisions to run, comma-separated; int4:ROUTE picks the CPU profile's int4_route",
    )
    p.add_argument("--prompt-lens", default="32,1000", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, help="threads for every engine (default: torch's own choice)")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS child processes")
    p.add_argument("--json", dest="json_path", default=str(RESULTS), help=f"write the rows here (default {RESULTS})")
    p.add_argument("--rss-child", help=argparse.SUPPRESS)  # engine key a child process runs once, printing its RSS
    return p.parse_args(argv)


def machine() -> dict:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or platform.machine(),
    )
    return {
        "host": platform.node(),
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "flashnext": version("flashnext"),
        "python": platform.python_version(),
        "onnxruntime": _version("onnxruntime"),
        "transformers": _version("transformers"),
        "load_average": os.getloadavg(),
    }


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def llamacpp_build() -> dict | None:
    """llama-cpp-python's version and what its ggml was compiled with (None: not installed)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
    }


# ---------------------------------------------------------------------------------------------------------------
# engines: each is a callable (ids, gen_len) -> (start time, time of each new token, new token ids)


def flashnext_runner(model, spec: str, max_len: int):
    """`model`: a LoadedModel, or a path (None: the default model) LLM loads itself, as `flashnext run` does."""
    precision, _, route = spec.partition(":")
    # Every repetition sends the same prompt: with the prefix cache on, it would skip the prefill it measures.
    settings = dict(max_num_seqs=1, max_model_len=max_len, prefix_caching=False)
    if route:
        settings["int4_route"] = route
    llm = LLM(model, backend="cpu", precision=precision, **settings)
    engine = llm.engine

    def run(ids, gen_len):
        start = time.perf_counter()
        seq = engine.add_request(ids, SamplingParams(max_tokens=gen_len, ignore_eos=True))
        times = []
        while engine.has_work():
            if any(out.new_token_ids for out in engine.step()):
                times.append(time.perf_counter())
        return start, times, seq.output_ids

    run.tokenizer = llm.tokenizer
    return run


def llamacpp_runner(gguf: Path, max_len: int):
    import llama_cpp

    check_llamacpp_decodes(gguf)
    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(
        model_path=str(gguf), n_ctx=max_len, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False
    )

    def run(ids, gen_len):
        llm.reset()  # no reuse of the last run's KV cache: every run prefills the whole prompt
        times, out = [], []
        start = time.perf_counter()
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            times.append(time.perf_counter())
            out.append(token)
            if len(out) == gen_len:
                break
        return start, times, out

    return run


# Two greedy tokens in a child process: a llama.cpp build that dies on this CPU dies there, not in the benchmark.
LLAMACPP_SMOKE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
for i, _ in enumerate(llm.generate([100, 101, 102], top_k=1, temp=0.0)):
    if i == 1:
        break
"""


def check_llamacpp_decodes(gguf: Path, script: str = LLAMACPP_SMOKE) -> None:
    """One clear line instead of the benchmark's death when llama.cpp crashes here (llama-cpp-python 0.3.36 built
    with `GGML_NATIVE` on an Intel VM with AMX died at its first decode)."""
    done = subprocess.run([sys.executable, "-c", script, str(gguf)], capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return
    how = f"signal {signal.Signals(-done.returncode).name}" if done.returncode < 0 else f"exit code {done.returncode}"
    raise SystemExit(
        f"llama.cpp (llama-cpp-python {_version('llama-cpp-python')}) died decoding two tokens of {gguf.name} ({how});"
        " rebuild it without the instruction set it fails on (docs/benchmarks.md: the build without AMX) or leave"
        " llama.cpp out of --engines"
    )


def transformers_runner(loaded, folder: Path):
    import transformers
    from safetensors.torch import save_file

    c = loaded.config
    if c.architecture != "llama" or c.rope_scaling is not None:
        raise SystemExit(f"this benchmark compares against LlamaForCausalLM; {loaded.source} is not a plain Llama")
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=None,
        pad_token_id=0,
    )
    # Our canonical names are HF's: LlamaForCausalLM loads our dequantized weights the usual way.
    state = {
        k: (w if isinstance(w, torch.Tensor) else w.dequantize(torch.float32)).float().contiguous()
        for k, w in loaded.weights.items()
    }
    config.save_pretrained(folder)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly gen_len tokens, like ignore_eos on our side
    model.generation_config.pad_token_id = 0

    class TokenClock(transformers.StoppingCriteria):
        """Called by `generate` after every new token: records when it came, never stops anything."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def run(ids, gen_len):
        clock = TokenClock()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=gen_len,
                stopping_criteria=transformers.StoppingCriteriaList([clock]),
            )
        return start, clock.times, out[0, len(ids) :].tolist()

    return run


def runners(args, loaded, gguf: Path | None, max_len: int, folder: Path, only: str | None = None) -> dict:
    """(engine, precision) -> run, for the engines asked for and available."""
    out = {}
    for engine in args.engines.split(","):
        if engine not in ENGINES:
            raise SystemExit(f"--engines: unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
        if engine == "flashnext":
            for precision in args.precisions.split(","):
                out[(engine, precision)] = None
        elif engine == "llama.cpp":
            if gguf is not None and llamacpp_build() is not None:
                out[(engine, "gguf")] = None
        else:
            out[(engine, "fp32")] = None
    for key in out:
        if only is not None and "/".join(key) != only:
            continue
        engine, precision = key
        if engine == "flashnext":
            out[key] = flashnext_runner(loaded, precision, max_len)
        elif engine == "llama.cpp":
            out[key] = llamacpp_runner(gguf, max_len)
        else:
            out[key] = transformers_runner(loaded, folder)
    return {k: v for k, v in out.items() if v is not None}


def rates(start: float, times: list[float], prompt_len: int) -> dict:
    ttft = times[0] - start
    return {
        "ttft_s": ttft,
        "prefill_tok_s": prompt_len / ttft,
        "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
    }


def prompt_ids(tokenizer, length: int) -> list[int]:
    return tokenizer.encode(PROSE * (1 + length // 40))[:length]


# Before each run: the engine before it leaves threads spinning for the next op (llama.cpp's OpenMP team for up to
# ~0.3 s, by libgomp's default spin count), which would take the cores from whoever runs next.
QUIET_S = 1.0


def peak_rss_mib(key: tuple[str, str], args, gguf: Path | None) -> float:
    """Peak RSS of a fresh process that loads the model with one engine and runs the longest prompt once."""
    prompt_len = max(int(n) for n in args.prompt_lens.split(","))
    if key[0] == "llama.cpp":
        cmd = [
            sys.executable,
            "-c",
            LLAMACPP_RSS,
            str(gguf),
            str(prompt_len),
            str(args.gen_len),
            str(torch.get_num_threads()),
        ]
    else:
        cmd = [
            sys.executable,
            __file__,
            "--rss-child",
            "/".join(key),
            "--engines",
            key[0],
            "--gen-len",
            str(args.gen_len),
            "--prompt-lens",
            str(prompt_len),
            "--precisions",
            key[1],
        ]
        cmd += ["--model", args.model] if args.model else []
        cmd += ["--threads", str(args.threads)] if args.threads else []
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def rss_child(args, gguf: Path | None, prompt_len: int, max_len: int) -> None:
    """Runs one flashnext or transformers engine once and prints the process's peak RSS in MiB."""
    key = tuple(args.rss_child.split("/"))
    if key[0] == "flashnext":  # loaded by LLM itself, as `flashnext run` loads it: no loader tensors kept beside
        run = flashnext_runner(args.model, key[1], max_len)
        run(prompt_ids(run.tokenizer, prompt_len), args.gen_len)
        return print(peak_rss_of_this_process())
    loaded = load_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        runners(args, loaded, gguf, max_len, Path(tmp), only=args.rss_child)[key](
            prompt_ids(loaded.tokenizer, prompt_len), args.gen_len
        )
    print(peak_rss_of_this_process())


def peak_rss_of_this_process() -> float:
    """VmHWM in MiB: ru_maxrss would carry the parent's peak over fork and exec."""
    line = next(li for li in Path("/proc/self/status").read_text().splitlines() if li.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


# llama.cpp's child imports nothing but llama_cpp (torch alone would add its libraries to the RSS); token ids
# 100, 101, ...: which tokens they are does not change the memory.
LLAMACPP_RSS = """
import sys, llama_cpp
gguf, prompt_len, gen_len, threads = sys.argv[1], *map(int, sys.argv[2:])
llm = llama_cpp.Llama(model_path=gguf, n_ctx=prompt_len + gen_len + 16, n_batch=512, n_threads=threads,
                      n_threads_batch=threads, verbose=False)
for i, _ in enumerate(llm.generate(list(range(100, 100 + prompt_len)), top_k=1, temp=0.0)):
    if i + 1 == gen_len:
        break
status = open("/proc/self/status").read().splitlines()
print(int(next(li for li in status if li.startswith("VmHWM:")).split()[1]) / 1024)
"""


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    gguf = default_model_path() if args.model is None else (Path(args.model) if args.model.endswith(".gguf") else None)
    lengths = [int(n) for n in args.prompt_lens.split(",")]
    max_len = max(lengths) + args.gen_len + 16
    if args.rss_child:
        return rss_child(args, gguf, max(lengths), max_len)
    loaded = load_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        engines = runners(args, loaded, gguf, max_len, Path(tmp))
        load_before = os.getloadavg()
        samples, outputs = {}, {}
        for length in lengths:
            ids = prompt_ids(loaded.tokenizer, length)
            for key, run in engines.items():  # warm-up: one-time conversions, allocator, thread pools
                outputs[(length, *key)] = run(ids, args.gen_len)[2]
            for rep in range(args.repeats):
                order = list(engines.items())
                for key, run in order[rep % len(order) :] + order[: rep % len(order)]:  # who goes first rotates
                    time.sleep(QUIET_S)
                    start, times, _ = run(ids, args.gen_len)
                    samples.setdefault((length, *key), []).append(rates(start, times, len(ids)))
                    console.log(
                        f"prompt {len(ids)} rep {rep + 1}/{args.repeats} {key[0]} {key[1]}: prefill "
                        f"{samples[(length, *key)][-1]['prefill_tok_s']:.1f}, decode "
                        f"{samples[(length, *key)][-1]['decode_tok_s']:.1f} tok/s"
                    )
    rss = {} if args.no_rss else {key: peak_rss_mib(key, args, gguf) for key in engines}
    rows = summarize(samples, outputs, rss, args, load_before)
    print_table(rows)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(rows, indent=2))
    return rows


def summarize(samples: dict, outputs: dict, rss: dict, args, load_before) -> list[dict]:
    base = {
        "machine": machine() | {"load_average_before": load_before},
        "llama_cpp": llamacpp_build(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model or "SmolLM2-135M-Instruct.Q4_1.gguf (embedded)",
        "backend": "cpu",
        "batch_size": 1,
        "gen_len": args.gen_len,
        "repeats": args.repeats,
    }
    medians = {key: {m: statistics.median(s[m] for s in runs) for m in runs[0]} for key, runs in samples.items()}
    rows = []
    for (length, engine, precision), med in medians.items():
        row = base | {"prompt_len": length, "engine": engine, "precision": precision} | med
        row["peak_rss_mib"] = rss.get((engine, precision))
        ref = (length, "llama.cpp", "gguf")
        if ref in medians:
            row["prefill_vs_llamacpp"] = med["prefill_tok_s"] / medians[ref]["prefill_tok_s"]
            row["decode_vs_llamacpp"] = med["decode_tok_s"] / medians[ref]["decode_tok_s"]
            # Per-run ratios with the engines alternated: robust to load that drifts over the run.
            ratios = [
                a["decode_tok_s"] / b["decode_tok_s"]
                for a, b in zip(samples[(length, engine, precision)], samples[ref])
            ]
            row["decode_vs_llamacpp_median_of_runs"] = statistics.median(ratios)
            mine, theirs = outputs[(length, engine, precision)], outputs[ref]
            row["tokens_agreeing_with_llamacpp"] = next(
                (i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs))
            )
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    m = rows[0]["machine"]
    table = Table(
        title=f"batch 1, {rows[0]['gen_len']} new tokens · {m['cpu']}, {m['threads']} threads, torch "
        f"{m['torch']}, load average {m['load_average_before'][0]:.1f}"
    )
    for col in (
        "prompt",
        "engine",
        "precision",
        "prefill tok/s",
        "decode tok/s",
        "prefill ×llama.cpp",
        "decode ×llama.cpp",
        "peak RSS MiB",
        "tokens = llama.cpp",
    ):
        table.add_column(col, justify="left" if col in ("engine", "precision") else "right")
    for r in rows:

        def cell(key, fmt="{:.2f}"):
            return fmt.format(r[key]) if r.get(key) is not None else "—"

        table.add_row(
            str(r["prompt_len"]),
            r["engine"],
            r["precision"],
            cell("prefill_tok_s", "{:.1f}"),
            cell("decode_tok_s", "{:.1f}"),
            cell("prefill_vs_llamacpp"),
            cell("decode_vs_llamacpp"),
            cell("peak_rss_mib", "{:.0f}"),
            cell("tokens_agreeing_with_llamacpp", "{}"),
        )
    Console().print(table)
    if rows[0]["llama_cpp"]:
        Console().print(
            f"llama.cpp: llama-cpp-python {rows[0]['llama_cpp']['llama_cpp_python']}; "
            f"{rows[0]['llama_cpp']['system_info']}"
        )


if __name__ == "__main__":
    main()
