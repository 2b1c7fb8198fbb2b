"""Tensor parallelism: TP = 1 against TP = N on the Qwen3-8B shape, and greedy equality on a tiny model.

Random bf16 weights of the shape are written once as an HF checkpoint (one safetensors file a layer) under
--work-dir, so every rank reads only its own slices, as it would a real checkpoint. For each size: decode tok/s at
batch 1 and 64 and 64 x (256 in, 128 out) end to end (`bench_rows`), each rank's resident host memory after
loading, and the all-reduces' share of a decode step: the 2 * layers + 1 all-reduces of [batch, hidden] and the
greedy candidates' gather a step makes, timed alone in a captured graph on the same ranks, over the step's time.
Greedy equality: a tiny random model, fp32, TP = 1 against TP = N token for token on a few prompts.

    python benchmarks/bench_tp.py --out tp.json                      # two GPUs: NCCL, CUDA graphs
    python benchmarks/bench_tp.py --one-gpu-check --out tp1gpu.json  # one GPU: two ranks through gloo, eager
    python benchmarks/bench_tp.py --backend cpu --shape tiny --batch-sizes 1,4 --prompt-len 16 --gen-len 8 --out x.json

--one-gpu-check runs only the greedy equality, with both ranks on the one GPU and gloo carrying the collectives
(NCCL refuses two ranks on one device), CUDA graphs off: a correctness check of the sharded forward, not a speed.
"""

import argparse
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from flashnext.core.cli_bench import SHAPES, bench_rows, parse_batch_sizes
from flashnext.core.config import ModelConfig
from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.llm import LLM

QWEN3_8B = SHAPES["qwen3-0.6b"].model_copy(
    update=dict(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, tie_word_embeddings=False)
)
TINY = ModelConfig(
    architecture="qwen3",
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    max_position_embeddings=1024,
    qk_norm=True,
)
SHAPE_CONFIGS = {"qwen3-8b": QWEN3_8B, "tiny": TINY}
HF_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "max_position_embeddings": "max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings",
}


def write_checkpoint(cfg: ModelConfig, folder: Path, seed: int = 0) -> Path:
    """Random weights (std 0.02, norms 1) as an HF Qwen3 folder, a layer at a time (host memory: one layer)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models

    if (folder / "model.safetensors.index.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def dense(*size):
        return (torch.randn(*size, generator=gen) * 0.02).to(torch.bfloat16)

    h, hd, ffn = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    weight_map = {}

    def save(name: str, tensors: dict) -> None:
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    top = {"model.embed_tokens.weight": dense(cfg.vocab_size, h), "model.norm.weight": torch.ones(h).bfloat16()}
    if not cfg.tie_word_embeddings:
        top["lm_head.weight"] = dense(cfg.vocab_size, h)
    save("top.safetensors", top)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        ones = {n: torch.ones(h).bfloat16() for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
        layer = {p + n: t for n, t in ones.items()} | {
            p + "self_attn.q_proj.weight": dense(q, h),
            p + "self_attn.k_proj.weight": dense(kv, h),
            p + "self_attn.v_proj.weight": dense(kv, h),
            p + "self_attn.o_proj.weight": dense(h, q),
            p + "self_attn.q_norm.weight": torch.ones(hd).bfloat16(),
            p + "self_attn.k_norm.weight": torch.ones(hd).bfloat16(),
            p + "mlp.gate_proj.weight": dense(ffn, h),
            p + "mlp.up_proj.weight": dense(ffn, h),
            p + "mlp.down_proj.weight": dense(h, ffn),
        }
        save(f"layer-{i:03d}.safetensors", layer)
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu"}
    config |= {hf: getattr(cfg, ours) for ours, hf in HF_FIELDS.items()}
    (folder / "config.json").write_text(json.dumps(config))
    Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def greedy_equality(folder: Path, backend: str, tp: int, profile: str | None, **settings) -> dict:
    """TP = 1 and TP = tp greedy tokens (fp32) on the same prompts: how many rows agree, where the first differs."""
    prompts = [[(7 * i + 3 * j) % 997 + 1 for j in range(5 + 9 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    outputs = []
    for size in (1, tp):
        llm = LLM(
            model=str(folder), backend=backend, precision="fp32", profile=profile, tensor_parallel=size, **settings
        )
        outputs.append([c.token_ids for c in llm.generate(prompts, params)])
        llm.close()
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(*outputs)]
    return {
        "tensor_parallel": tp,
        "rows": len(prompts),
        "rows_equal": sum(f is None for f in firsts),
        "first_difference": firsts,
        "comm": settings.get("tensor_parallel_comm", "auto"),
        "profile": profile,
    }


def _allreduce_rank(rank: int, size: int, port: int, cfg: ModelConfig, batches: list[int], out: str) -> None:
    """On each rank: the collectives of one decode step (2 * layers + 1 all-reduces of [batch, hidden] bf16, the
    greedy candidates' all-gather), captured in a graph and replayed; microseconds a step, written by rank 0."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=size)
    result = {}
    for b in batches:
        x = torch.randn(b, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        pairs, gathered = torch.zeros(b, 2, device="cuda"), torch.zeros(size * b, 2, device="cuda")

        def step():
            for _ in range(2 * cfg.num_layers + 1):
                dist.all_reduce(x)
            dist.all_gather_into_tensor(gathered, pairs)

        step()  # the communicator, eagerly
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
        start, iters = time.perf_counter(), 200
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
        result[b] = (time.perf_counter() - start) / iters * 1e6
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def allreduce_us(cfg: ModelConfig, size: int, batches: list[int]) -> dict[int, float]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "allreduce.json")
        mp.spawn(_allreduce_rank, args=(size, port, cfg, batches, out), nprocs=size)
        return {int(k): v for k, v in json.loads(Path(out).read_text()).items()}


def rss_gib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cuda")
    p.add_argument("--shape", choices=SHAPE_CONFIGS, default="qwen3-8b")
    p.add_argument("--tp", type=int, default=2, help="the tensor-parallel size compared with 1")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--profile", default=None, help="backend profile (default: the backend's; cuda: full, graphs)")
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "flashnext-bench-tp")
    p.add_argument("--one-gpu-check", action="store_true", help="greedy equality only, TP ranks on one GPU via gloo")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    batches = parse_batch_sizes(args.batch_sizes)
    report: dict = {"machine": platform.node(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tiny = write_checkpoint(TINY, args.work_dir / "tiny")
    if args.one_gpu_check:
        report["greedy"] = greedy_equality(
            tiny, args.backend, args.tp, "basic", tensor_parallel_comm="gloo", kv_cache_max_gib=1.0
        )
        _finish(report, args.out)
        return
    report["greedy"] = greedy_equality(tiny, args.backend, args.tp, args.profile)
    cfg = SHAPE_CONFIGS[args.shape]
    folder = write_checkpoint(cfg, args.work_dir / args.shape)
    comm = allreduce_us(cfg, args.tp, batches) if args.backend == "cuda" else {}
    rows = []
    for size in (1, args.tp):
        for row in bench_rows(
            str(folder),
            args.backend,
            "bf16",
            args.profile,
            batches,
            args.prompt_len,
            args.gen_len,
            tensor_parallel=size,
        ):
            row["rank0_rss_gib"] = round(rss_gib(), 2)
            step_us = row["batch_size"] / row["decode_tok_s"] * 1e6 if row["decode_tok_s"] else 0.0
            row["step_us"] = round(step_us, 1)
            if size > 1 and row["batch_size"] in comm and step_us:
                row["collectives_us"] = round(comm[row["batch_size"]], 1)
                row["collectives_share"] = round(comm[row["batch_size"]] / step_us, 3)
            rows.append(row)
    report["rows"] = rows
    _finish(report, args.out)


def _finish(report: dict, out: Path) -> None:
    out.write_text(json.dumps(report, indent=2) + "\n")
    g = report["greedy"]
    print(f"greedy, fp32, TP=1 vs TP={g['tensor_parallel']} ({g['comm']}): {g['rows_equal']}/{g['rows']} rows equal")
    if "rows" not in report:
        sys.exit(0 if g["rows_equal"] == g["rows"] else 1)
    table = Table("TP", "batch", "decode tok/s", "step us", "total tok/s", "wall s", "collectives", "rank-0 RSS GiB")
    for r in report["rows"]:
        share = f"{r['collectives_us']:.0f} us ({r['collectives_share']:.0%})" if "collectives_us" in r else "-"
        table.add_row(
            str(r["tensor_parallel"]),
            str(r["batch_size"]),
            f"{r['decode_tok_s']:.1f}",
            f"{r['step_us']:.0f}",
            f"{r['throughput_tok_s']:.1f}",
            f"{r['wall_s']:.2f}",
            share,
            f"{r['rank0_rss_gib']:.1f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
