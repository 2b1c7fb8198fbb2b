"""MTP speculative decoding in the CUDA graphs, batch 1: what a round costs and what it would gain.

    python benchmarks/bench_mtp.py [--json OUT] [--gen-len 256] [--draft-heads target,fp8]

Random Qwen3-0.6B-shaped weights (bf16) with one random DeepSeek-V3 style MTP module (with_mtp_module). Measures
on the GPU, graphs replayed directly (CUDA events around the replays only):
- a captured decode step of --spec none (and of --spec mtp, which keeps the step's target states for the module),
  and a captured MTP round (drafts + verify + verdict + catch-up) for
  K = 1, 2, 3, as a ratio to it (targets 1.6 / 1.9 / 2.2), and the probe's round (the one-draft graph the kind
  chooser's retries run while decode leads); the round twice: drafts rejected (the random module)
  and drafts accepted (the copying module, whose catch-up runs over all K + 1 rows);
- the round's parts, each captured alone: the drafts, and the catch-up (the rest is the verify step); and the
  wall time of the catch-up a spec chunk runs over positions decode steps left out;
- from those ratios, the per-token acceptance at which a round breaks even with decode steps and the speedup at
  85% and 90% (tokens a round = 1 + a + ... + a^K for acceptance a at each draft position, chain ending at the
  first miss);
- end to end through the engine (adaptive mode on, as shipped): --spec mtp vs --spec none tok/s, with the random
  module (acceptance ~0: adaptive mode must keep >= 0.9x) and with the copying module (acceptance ~1), the median
  of three runs after a warm-up run;
- each for every --draft-heads value (spec_draft_head: the target's bf16 LM head, or an fp8 copy for the drafts).
Prints a short table, writes every number as JSON.
"""

import argparse
import gc
import json
import time

import torch

from flashnext.core.cli_bench import machine_name, random_model, with_mtp_module
from flashnext.core.engine.runner import StepInput
from flashnext.core.engine.scheduler import ScheduledSeq
from flashnext.core.engine.sequence import SamplingParams, Sequence
from flashnext.core.llm import LLM
from flashnext.plugins.cuda import CudaBackend

SHAPE, KS, ACCEPTANCES = "qwen3-0.6b", (1, 2, 3), (0.85, 0.90)
TARGETS = {1: 1.6, 2: 1.9, 3: 2.2}
PROMPT_LEN, REPLAYS, RUNS = 64, 8, 3


def make_llm(loaded, spec: str, k: int = 1, head: str = "target") -> LLM:
    return LLM(
        model=loaded,
        backend="cuda",
        precision="bf16",
        profile="full",
        spec=spec,
        spec_tokens=k,
        spec_draft_head=head,
        max_model_len=1024,
        max_num_seqs=4,
        kv_cache_max_gib=1.0,
        prefix_caching=False,  # each run computes the whole prompt: the same shapes, so the same tokens
    )


def prefilled(llm: LLM) -> list[ScheduledSeq]:
    """One sequence with its prompt in the cache (the MTP catch-up too) and room for every replay."""
    runner, vocab = llm.engine.runner, llm.engine.config.vocab_size
    seq = Sequence([(7 * i + 3) % vocab for i in range(PROMPT_LEN)], SamplingParams(max_tokens=512, ignore_eos=True))
    seq.block_table = list(range(-(-1024 // runner.block_size)))
    result = runner.step(StepInput([ScheduledSeq(seq, PROMPT_LEN, 1)], want_hidden=True))
    seq.num_computed = PROMPT_LEN
    seq.token_ids.append(int(result.sampled[0]))
    return [ScheduledSeq(seq, 1, 1)]


def replay_us(graph, fill, rounds: int = 20) -> float:
    """Median GPU time of one replay: `fill` resets the inputs, then REPLAYS replays between two events."""
    times = []
    for _ in range(rounds):
        fill()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / REPLAYS)
    return sorted(times)[len(times) // 2]


def decode_step_us(llm: LLM) -> float:
    runner = llm.engine.runner
    batch = prefilled(llm)
    runner._ensure_graphs(batch, 1, True)

    def fill():  # the decode body writes its tokens at step_index: REPLAYS from 0
        runner._fill_inputs(batch, 1)
        runner.step_index.zero_()

    return replay_us(runner.graphs[(1, True, "decode")], fill)


def mtp_round_us(llm: LLM, kind: str = "spec") -> float:
    """A captured round of the full-width spec graph, or with kind "probe" of the one-draft graph the kind
    chooser's retries run while decode leads."""
    runner = llm.engine.runner
    batch = prefilled(llm)
    runner._ensure_graphs(batch, 1, True)
    key, q = (1, True, kind), runner._verify_rows(kind)
    return replay_us(runner.graphs[key], lambda: runner._fill_spec(batch, 1, q))


def round_parts_us(llm: LLM) -> dict[str, float]:
    """GPU time of the MTP round's parts, each captured on its own as the spec graph holds it: the drafts (plan,
    first draft, K - 1 chained steps) and the catch-up after one accepted token; the rest of the round is the
    K + 1-row verify step and the verdict."""
    runner = llm.engine.runner
    drafter, q, bs = runner.device_drafter, runner.verify_len, runner.block_size
    batch = prefilled(llm)
    runner._ensure_graphs(batch, 1, True)
    verify = tuple(runner.dev_verify_ints[i, :q] for i in (0, 1, 2)) + (runner.dev_context[:q],)
    verify += (runner.dev_verify_ints[3, :q],)
    state = tuple(runner.dev_spec[i, :1] for i in range(4))
    hist, tables, ntok = runner.dev_hist[:1], runner.dev_tables[:1], runner.dev_spec[0, :1]
    state = (hist,) + state + (runner.dev_n_draft[:1],)
    hidden = torch.randn(q, llm.engine.model.config.hidden_size, dtype=torch.bfloat16, device="cuda")

    def fill():  # the round's inputs, drafted once, then one token taken: the catch-up's rows
        runner._fill_spec(batch, 1)
        drafter.draft(state, verify, tables, bs)
        ntok.add_(1)

    parts = {
        "draft": lambda: drafter.draft(state, verify, tables, bs),
        "catch_up": lambda: drafter.after_verify(hidden, hidden, verify, hist, ntok, tables),
    }
    out = {}
    for name, body in parts.items():
        fill()
        with runner.graph_settings(1, q):
            body()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=runner.pool):
                body()
        out[name] = replay_us(graph, fill)
    return out


def tokens_per_round(acceptance: float, k: int) -> float:
    return sum(acceptance**i for i in range(k + 1))


def break_even(cost: float, k: int) -> float | None:
    """The acceptance at which a round's tokens equal its cost in decode steps (None: not within [0, 1])."""
    if cost > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_round(mid, k) < cost else (lo, mid)
    return round(hi, 4)


def tok_s(llm: LLM, gen_len: int) -> tuple[float, dict]:
    """Decode tok/s of one batch-1 request, the median of RUNS after the same request once (graphs captured, kernels
    compiled; an occasional first compile of an eager step's kernel lands in one run, not in the median)."""
    vocab = llm.engine.config.vocab_size
    prompt = [(11 * i + 5) % vocab for i in range(PROMPT_LEN)]
    params = SamplingParams(max_tokens=gen_len, ignore_eos=True)
    [first] = llm.engine.generate([prompt], params)
    before = llm.engine.spec_stats()
    rates = []
    for _ in range(RUNS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        [seq] = llm.engine.generate([prompt], params)
        torch.cuda.synchronize()
        rates.append(len(seq.output_ids) / (time.perf_counter() - start))
        assert seq.output_ids == first.output_ids
    after = llm.engine.spec_stats()
    spec = {key: after[key] - before[key] for key in ("drafts", "drafted", "accepted")}
    return sorted(rates)[RUNS // 2], spec | {"runs_tok_s": [round(r, 1) for r in rates], "tokens": seq.output_ids}


def catch_up_after_decode_us(llm: LLM, rounds: int = 10) -> float:
    """Wall time (host and GPU) of the module's catch-up over PROMPT_LEN - 1 positions decode steps left out, as a
    spec chunk after them runs it (before_spec)."""
    runner = llm.engine.runner
    [item] = prefilled(llm)
    times = []
    for _ in range(rounds):
        item.seq.spec_tracker.behind = 1
        torch.cuda.synchronize()
        start = time.perf_counter()
        runner.device_drafter.before_spec([item])
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return sorted(times)[rounds // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every number here")
    parser.add_argument("--gen-len", type=int, default=256)
    parser.add_argument("--draft-heads", default="target,fp8", help="spec_draft_head values, comma-separated")
    args = parser.parse_args()
    heads = args.draft_heads.split(",")
    dev = torch.device("cuda")
    base = random_model(SHAPE, dev)
    models = {"rejecting": with_mtp_module(base), "accepting": with_mtp_module(base, copying=True)}
    machine = machine_name(CudaBackend())
    out: dict = {"machine": machine, "shape": SHAPE, "batch": 1, "precision": "bf16", "heads": heads}
    out |= {"rounds": {}, "e2e": {}}
    for name, loaded in models.items():
        none = make_llm(loaded, "none")
        step = decode_step_us(none)
        none_tok_s, none_run = tok_s(none, args.gen_len)
        del none
        out["rounds"][name] = {"decode_step_us": round(step, 1)}
        out["e2e"][name] = {"none_tok_s": round(none_tok_s, 1)}
        for k, head in ((k, head) for k in KS for head in heads):
            llm = make_llm(loaded, "mtp", k, head)
            round_us = mtp_round_us(llm)
            cost = round_us / step
            probe = mtp_round_us(llm, llm.engine.runner._probe_kind()) / step
            parts = {f"{name}_over_decode": round(us / step, 3) for name, us in round_parts_us(llm).items()}
            decode = decode_step_us(llm) / step  # its decode steps keep the target's states for the module
            catch_up_us = catch_up_after_decode_us(llm)
            rate, run = tok_s(llm, args.gen_len)
            key = variant(k, head)
            out["rounds"][name][key] = {
                "round_over_decode": round(cost, 3),
                "target": TARGETS[k],
                "probe_round_over_decode": round(probe, 3),
                "mtp_decode_step_over_decode": round(decode, 3),
                **parts,
                f"catch_up_after_decode_{PROMPT_LEN - 1}_positions_us": round(catch_up_us, 1),
            }
            out["e2e"][name][key] = {
                "mtp_tok_s": round(rate, 1),
                "mtp_over_none": round(rate / none_tok_s, 3),
                "lossless": run.pop("tokens") == none_run["tokens"],
                **run,
            }
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    for k, head in ((k, head) for k in KS for head in heads):
        cost = out["rounds"]["rejecting"][variant(k, head)]["round_over_decode"]
        out["rounds"][f"projection_{variant(k, head)}"] = {
            "break_even_acceptance": break_even(cost, k),
            **{f"speedup_at_{a}": round(tokens_per_round(a, k) / cost, 3) for a in ACCEPTANCES},
        }
    print_table(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


def variant(k: int, head: str) -> str:
    return f"k{k}" if head == "target" else f"k{k}_{head}_head"


def print_table(out: dict) -> None:
    rounds, e2e = out["rounds"], out["e2e"]
    print(f"{out['machine']}  {SHAPE} bf16 batch 1, decode step {rounds['rejecting']['decode_step_us']} us")
    print(
        " K  head    round/decode (target)  probe  draft  catch-up  accepted-round  break-even  x@85%  x@90%"
        "  mtp/none rej"
        "  mtp/none acc  lossless"
    )
    for k, head in ((k, head) for k in KS for head in out["heads"]):
        key = variant(k, head)
        rej, acc, proj = rounds["rejecting"][key], rounds["accepting"][key], rounds[f"projection_{key}"]
        e_rej, e_acc = e2e["rejecting"][key], e2e["accepting"][key]
        print(
            f" {k}  {head:<6}  {rej['round_over_decode']:>5} ({rej['target']})  {rej['probe_round_over_decode']:>5}"
            f"  {rej['draft_over_decode']:>5}  {rej['catch_up_over_decode']:>8}"
            f"  {acc['round_over_decode']:>14}  {proj['break_even_acceptance']!s:>10}"
            f"  {proj['speedup_at_0.85']:>5}  {proj['speedup_at_0.9']:>5}"
            f"  {e_rej['mtp_over_none']:>12}  {e_acc['mtp_over_none']:>12}"
            f"  {e_rej['lossless'] and e_acc['lossless']}"
        )


if __name__ == "__main__":
    main()
