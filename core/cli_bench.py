"""`flashnext bench`: time-to-first-token, decode and end-to-end throughput per batch size (DESIGN.md keys).

`--shape` builds random weights of a known model's shape on the backend's device, so the numbers need no download
and run anywhere (tiny settings make a CPU smoke test). Every prompt is distinct random tokens, so the prefix cache
never helps, and every request generates exactly --gen-len tokens (EOS ignored).
"""

import json
import os
import platform
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from . import progress, registry
from .config import ModelConfig
from .engine.sequence import SamplingParams
from .errors import UserError
from .llm import LLM
from .loader import LoadedModel
from .precision import int4_quantize
from .threads import apply_setting

SHAPES = {
    "qwen3-0.6b": ModelConfig(
        architecture="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        qk_norm=True,
    ),
    "smollm2-135m": ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100_000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
}


class RandomVocabulary:
    """Stands in for a tokenizer when weights are random: token ids only, no end-of-sequence token."""

    eos_token_ids: list[int] = []

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


# Where torch allocates unless told otherwise: host memory, where a checkpoint is read too.
HOST = torch.get_default_device()


def random_model(shape: str, device: torch.device, seed: int = 0) -> LoadedModel:
    """Weights of the given shape drawn on `device` (bf16; std 0.02, norms 1), named as HF checkpoints name them."""
    if shape not in SHAPES:
        raise UserError(f"unknown --shape '{shape}': choose one of {', '.join(SHAPES)}")
    return random_model_of(SHAPES[shape], shape, device, seed)


def random_model_of(cfg: ModelConfig, shape: str, device: torch.device, seed: int = 0) -> LoadedModel:
    """random_model for any config (benchmarks of other sizes); an untied one gets its own lm_head."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def dense(*size):
        return (torch.randn(*size, generator=gen, device=device) * 0.02).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16, device=device)

    h, q, kv, ffn = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    weights = {"model.embed_tokens.weight": dense(cfg.vocab_size, h), "model.norm.weight": ones(h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": dense(q, h),
            p + "self_attn.k_proj.weight": dense(kv, h),
            p + "self_attn.v_proj.weight": dense(kv, h),
            p + "self_attn.o_proj.weight": dense(h, q),
            p + "mlp.gate_proj.weight": dense(ffn, h),
            p + "mlp.up_proj.weight": dense(ffn, h),
            p + "mlp.down_proj.weight": dense(h, ffn),
        }
        if cfg.qk_norm:
            weights |= {
                p + "self_attn.q_norm.weight": ones(cfg.head_dim),
                p + "self_attn.k_norm.weight": ones(cfg.head_dim),
            }
    if not cfg.tie_word_embeddings:
        weights["lm_head.weight"] = dense(cfg.vocab_size, h)
    return LoadedModel(cfg, weights, RandomVocabulary(), f"random:{shape}", shape)


def with_mtp_module(loaded: LoadedModel, copying: bool = False, seed: int = 1) -> LoadedModel:
    """`loaded` plus one DeepSeek-V3 style MTP module of its shape (random, std 0.02, norms 1), for --spec mtp.

    copying: a module that predicts what the target does, so drafts are accepted: the target's layers add nothing
    to the residual stream (o and down projections zero, computed all the same), so its next token is a function of
    the current one alone, head(norm(embed(t))); the module reads only its token (eh_proj = [I | 0], its own o and
    down zero) and its head norm is the target's, so draft i is that function applied i times: the very tokens the
    target samples greedily, but where re-norming an already-normed state rounds a near-tie the other way."""
    cfg = loaded.config.model_copy(update={"num_mtp_modules": 1})
    weights = dict(loaded.weights)
    ref = weights["model.embed_tokens.weight"]
    gen = torch.Generator(device=ref.device).manual_seed(seed)
    h = cfg.hidden_size
    block = random_model_of(cfg.model_copy(update={"num_layers": 1}), "mtp", ref.device, seed).weights
    prefix = f"model.layers.{cfg.num_layers}."
    weights |= {k.replace("model.layers.0.", prefix): v for k, v in block.items() if k.startswith("model.layers.0.")}
    weights |= {prefix + n: torch.ones(h, dtype=ref.dtype, device=ref.device) for n in ("enorm.weight", "hnorm.weight")}
    weights[prefix + "shared_head.norm.weight"] = weights["model.norm.weight"].clone()
    weights[prefix + "eh_proj.weight"] = (torch.randn(h, 2 * h, generator=gen, device=ref.device) * 0.02).to(ref.dtype)
    if copying:
        weights[prefix + "eh_proj.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1).to(ref)
        for i in range(cfg.num_layers + 1):
            for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                weights[f"model.layers.{i}.{name}"] = torch.zeros_like(weights[f"model.layers.{i}.{name}"])
    return LoadedModel(cfg, weights, loaded.tokenizer, loaded.source + "+mtp", loaded.name)


@dataclass
class Timing:
    ttft_s: float
    decode_tok_s: float
    throughput_tok_s: float
    wall_s: float


def load_bench_model(model: str | None, shape: str | None, seed: int = 0) -> LoadedModel:
    """Random weights of `shape`, else the checkpoint `model` (None: the embedded one). Random weights are built on
    the CPU, as a checkpoint is read: the engine moves (or quantizes) what it keeps, so an accelerator holds only
    the engine's weights and the reported peak memory is the engine's (built on the device, the bf16 originals of
    int4 or fp8 weights would stay there beside them)."""
    from .loader import load_model

    if model and shape:
        raise UserError("give --model or --shape, not both")
    if shape:
        return random_model(shape, HOST, seed)
    return load_model(model)


def time_generation(llm: LLM, batch_size: int, prompt_len: int, gen_len: int, seed: int = 0) -> Timing:
    """All requests arrive at once; TTFT is the mean over requests, decode counts tokens after each first one."""
    engine = llm.engine
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    prompts = torch.randint(0, vocab, (batch_size, prompt_len), generator=gen).tolist()
    start = time.perf_counter()
    seqs = [engine.add_request(p, params) for p in prompts]
    first: dict[int, float] = {}
    while engine.has_work():
        for out in engine.step():
            if out.new_token_ids and id(out.seq) not in first:
                first[id(out.seq)] = time.perf_counter()
    end = time.perf_counter()
    produced = sum(len(s.output_ids) for s in seqs)
    last_first = max(first.values())
    decode_s = end - last_first
    return Timing(
        ttft_s=sum(t - start for t in first.values()) / len(first),
        decode_tok_s=(produced - len(seqs)) / decode_s if decode_s > 0 and gen_len > 1 else 0.0,
        throughput_tok_s=produced / (end - start),
        wall_s=end - start,
    )


def machine_name(backend) -> str:
    return f"{platform.node()} / {backend.device_name()}"


def _flashnext_version() -> str:
    try:
        return version("flashnext")
    except PackageNotFoundError:
        return "unknown"


def bench_rows(
    loaded: LoadedModel | str | None,
    backend: str,
    precision: str | None,
    profile: str | None,
    batch_sizes: list[int],
    prompt_len: int,
    gen_len: int,
    configure=None,
    on_row=None,
    **overrides,
) -> list[dict]:
    """One engine for all batch sizes (room for the largest); a short warm-up run per size first.

    `configure(llm)` may adjust the engine before anything runs (benchmark scripts comparing kernel variants);
    `on_row(row)` sees each configuration's row as soon as it is measured. A row's warm_up_s is the one-time work
    (weight expansion, compiles, graph captures) done before its timed run, from the engine's start."""
    largest = max(batch_sizes)
    settings = dict(max_model_len=max(16, prompt_len + gen_len + 16), max_num_seqs=max(largest, 1))
    llm = LLM(model=loaded, backend=backend, precision=precision, profile=profile, **(settings | overrides))
    if configure:
        configure(llm)
    llm.warm_up()
    rows = []
    with progress.stage("bench", total=len(batch_sizes)) as advance:
        for b in batch_sizes:
            rows.append(_bench_row(llm, b, prompt_len, gen_len))
            if on_row:
                on_row(rows[-1])
            r = rows[-1]
            advance(
                f"batch {b}: ttft {r['ttft_s']:.3f} s, decode {r['decode_tok_s']:.1f} tok/s, "
                f"throughput {r['throughput_tok_s']:.1f} tok/s"
            )
    llm.close()
    return rows


def _bench_row(llm: LLM, b: int, prompt_len: int, gen_len: int) -> dict:
    backend = llm.engine.backend
    time_generation(llm, b, prompt_len, min(gen_len, 24), seed=1000 + b)  # compile, capture, fill caches
    backend.synchronize()
    backend.reset_memory_peak()
    t = time_generation(llm, b, prompt_len, gen_len, seed=b)
    runner = llm.engine.runner.stats()
    return {
        "machine": machine_name(backend),
        "backend": llm.info.backend,
        "shape": llm.info.model,
        "precision": llm.engine.precision.name,
        "profile": llm.profile.name,
        "cuda_graphs": llm.profile.cuda_graphs,
        "tensor_parallel": llm.profile.tensor_parallel,
        "batch_size": b,
        "prompt_len": prompt_len,
        "gen_len": gen_len,
        "ttft_s": round(t.ttft_s, 5),
        "decode_tok_s": round(t.decode_tok_s, 1),
        "throughput_tok_s": round(t.throughput_tok_s, 1),
        "wall_s": round(t.wall_s, 4),
        "warm_up_s": round(llm.warm_up_s, 4),
        "threads": llm.threads.threads,
        "peak_memory_bytes": backend.memory_peak_bytes(),
        "graph_captures": runner.graph_captures,
        "graph_replays": runner.graph_replays,
        "graph_memory_bytes": runner.graph_memory_bytes,
        "flashnext_version": _flashnext_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise UserError(f"--batch-sizes '{text}' is not a comma-separated list of positive integers (e.g. 1,8,64)")
    return sizes


def default_precision(backend: str, shape: str | None) -> str | None:
    """The precision a user gets without --precision: for random weights (--shape), the one the backend picks for
    the embedded default model, whose projections are stored in 4 bits (Q4_1); a checkpoint picks its own (None)."""
    if shape is None:
        return None
    stored_like_default_model = {"q_proj": int4_quantize(torch.zeros(1, 32), group_size=32)}
    return registry.select(registry.discover(), backend).backend.preferred_precision(stored_like_default_model)


def run_bench(
    backend: str,
    model: str | None,
    shape: str | None,
    batch_sizes: str,
    prompt_len: int,
    gen_len: int,
    precision: str | None,
    profile: str | None,
    json_path: Path | None,
    threads: int | None,
    tensor_parallel: int | None = None,
) -> None:
    """`flashnext bench`: the table on stdout, and --json rewritten after every configuration, so a run cut short
    still leaves valid JSON with the rows measured so far."""
    from rich.console import Console
    from rich.table import Column, Table

    sizes = parse_batch_sizes(batch_sizes)
    if json_path is not None and not json_path.parent.is_dir():
        raise UserError(f"--json {json_path}: the folder {json_path.parent} does not exist; create it first")
    rows: list[dict] = []

    def keep(row: dict) -> None:
        rows.append(row)
        if json_path is not None:
            partial = json_path.with_name(json_path.name + ".partial")
            partial.write_text(json.dumps(rows, indent=2) + "\n")
            os.replace(partial, json_path)

    apply_setting(threads)  # before the random weights are drawn, which take a while on a busy machine
    with progress.shown():
        if shape or (tensor_parallel or 1) == 1:
            with progress.stage("building random weights" if shape else "loading model") as advance:
                loaded = load_bench_model(model, shape)
                advance(loaded.name)
        else:  # each rank reads its own shard of the checkpoint
            loaded = model
        bench_rows(
            loaded,
            backend,
            precision or default_precision(backend, shape),
            profile,
            sizes,
            prompt_len,
            gen_len,
            on_row=keep,
            threads=threads,
            tensor_parallel=tensor_parallel,
        )
    # Fits 80 columns (a log, a pipe) without cutting a word: "total" is throughput_tok_s.
    table = Table(
        "batch",
        Column("precision", min_width=9, no_wrap=True),
        "profile",
        "ttft s",
        "decode tok/s",
        "total tok/s",
        "warm-up s",
        "peak MiB",
    )
    for r in rows:
        table.add_row(
            str(r["batch_size"]),
            r["precision"],
            r["profile"],
            f"{r['ttft_s']:.4f}",
            f"{r['decode_tok_s']:.1f}",
            f"{r['throughput_tok_s']:.1f}",
            f"{r['warm_up_s']:.2f}",
            f"{r['peak_memory_bytes'] / 2**20:.0f}",
        )
    Console().print(table)
