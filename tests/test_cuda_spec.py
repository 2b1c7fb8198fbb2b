"""CUDA verify step for n-gram speculative decoding: the padded K + 1 rows against the eager reference (CPU, Triton
interpreter), and on a GPU the captured verify graph against plain decoding."""

import os
import time

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is a test dependency (pip install triton)")

from flashnext.core.cli_bench import random_model  # noqa: E402
from flashnext.core.engine.runner import ModelRunner, RunnerSetup  # noqa: E402
from flashnext.core.engine.scheduler import ScheduledSeq  # noqa: E402
from flashnext.core.engine.sequence import SamplingParams, Sequence  # noqa: E402
from flashnext.core.kernels import ReferenceKernels  # noqa: E402
from flashnext.core.model import DecoderModel  # noqa: E402
from flashnext.core.precision import PRECISIONS  # noqa: E402
from flashnext.core.profile import Profile  # noqa: E402
from flashnext.core.spec.ngram import lookup  # noqa: E402
from flashnext.plugins.cuda import CudaBackend  # noqa: E402
from flashnext.plugins.cuda.kernels import CudaKernels  # noqa: E402
from flashnext.plugins.cuda.launch import LARGE_GEMV_MAX_ROWS, LONG_GEMV_MAX_ROWS  # noqa: E402
from flashnext.plugins.cuda.runner import MAX_DECODE_STEPS, SPEC_CHUNK_STEPS, CudaGraphRunner, _Lookahead, copy_yield  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NGRAM = Profile(name="full", cuda_graphs=True, spec="ngram", spec_tokens=3, graph_batch_sizes=[1, 2, 4])


# A repetitive prompt: n-gram drafts hit, so a device spec chunk takes several tokens a step.
MOTIF = [5, 9, 14, 3, 8, 21, 7]
REPEATING_PROMPT = MOTIF * 4 + MOTIF[:3]


def _tiny_runner(tiny_random, block_size=4, profile=NGRAM, device=torch.device("cpu"), eos_ids=frozenset()):
    """A CUDA graph runner over the tiny model (32 KV blocks, fp32): on the CPU by default, for its host-side logic
    (no graphs run); on DEV for the step bodies, run eagerly."""
    model = DecoderModel(
        tiny_random.config, tiny_random.weights, CudaKernels(), PRECISIONS["fp32"], device, torch.float32
    )
    return CudaGraphRunner.for_profile(profile)(model, RunnerSetup(32, block_size, torch.float32, frozenset(eos_ids)))


def _prefilled(runner, prompts):
    """Sequences whose prompts are in `runner`'s KV cache, each with its first token appended."""
    seqs = []
    for i, prompt in enumerate(prompts):
        seq = Sequence(list(prompt), SamplingParams())
        seq.block_table = list(range(8 * i, 8 * i + 8))
        seqs.append(seq)
    runner.run([ScheduledSeq(s, len(s), 1) for s in seqs])
    for s in seqs:
        s.num_computed = len(s)
        s.token_ids.append(7)
    return seqs


def _verify_batch(seqs, drafts):
    for s, d in zip(seqs, drafts):
        s.draft_ids = list(d)
    return [ScheduledSeq(s, 1 + len(d), 1 + len(d)) for s, d in zip(seqs, drafts)]


@pytest.mark.parametrize("verify_rows", [4, 2], ids=["spec", "probe"])
def test_spec_chunk_on_the_device_yields_the_plain_decode_tokens(tiny_random, verify_rows):
    """Device drafting + verify + accept, chained (the graph body run eagerly): the history it grows is the greedy
    continuation step-by-step decoding gives, several tokens a step on a repetitive prompt; the probe graph's
    narrower steps (one draft each, counted in the full-width counters) too."""
    runner = _tiny_runner(tiny_random, device=DEV)
    assert runner.spec_rows == 4 and runner.lookahead_tokens == max(2 * MAX_DECODE_STEPS, 2 * SPEC_CHUNK_STEPS * 4)
    [seq] = _prefilled(runner, [REPEATING_PROMPT])
    seq.params = SamplingParams(max_tokens=20, ignore_eos=True)
    seq.block_table = list(range(16))  # room for the whole look-ahead
    starts = runner._fill_spec([ScheduledSeq(seq, 1, 1)], 1, verify_rows)
    for _ in range(3):
        runner._spec_body(1, greedy=True, q=verify_rows)
    ntok = int(runner.dev_spec[0, 0])
    produced = runner.dev_hist[0, starts[0] : ntok].tolist()
    steps, drafts, drafted, accepted, *per_position = runner.dev_spec_stats[0].tolist()
    assert steps == 3 and len(produced) == 3 + accepted and drafted > 0 and per_position[0] <= drafts <= steps
    assert drafted <= steps * (verify_rows - 1) and per_position[verify_rows - 1 :] == [0] * (4 - verify_rows)

    ref_model = DecoderModel(
        tiny_random.config, tiny_random.weights, ReferenceKernels(), PRECISIONS["fp32"], DEV, torch.float32
    )
    ref = ModelRunner(ref_model, RunnerSetup(32, 4, torch.float32))
    [ref_seq] = _prefilled(ref, [REPEATING_PROMPT])
    ref_seq.block_table = list(range(16))
    expected = []
    for _ in produced:
        _, sampled = ref.run([ScheduledSeq(ref_seq, 1, 1)])
        ref_seq.num_computed += 1
        ref_seq.token_ids.append(int(sampled[0]))
        expected.append(int(sampled[0]))
    assert produced == expected


def test_a_spec_chunk_ends_a_sequence_at_its_stop_token_on_the_device(tiny_random):
    """With a token the chunk produces as an EOS id, the device history ends at its first occurrence and the
    chunk's later steps leave the finished row alone (no tokens, no steps counted); a request that ignores EOS, or
    whose stop_token_ids name it, is treated as the engine would."""

    def chunk(eos_ids=frozenset(), **params):
        runner = _tiny_runner(tiny_random, device=DEV, eos_ids=eos_ids)
        [seq] = _prefilled(runner, [REPEATING_PROMPT])
        seq.params = SamplingParams(max_tokens=20, **params)
        seq.block_table = list(range(16))
        [start] = runner._fill_spec([ScheduledSeq(seq, 1, 1)], 1)
        for _ in range(3):
            runner._spec_body(1, greedy=True)
        stops = runner.host_stops[0].tolist()
        return runner.dev_hist[0, start : int(runner.dev_spec[0, 0])].tolist(), int(runner.dev_spec_stats[0, 0]), stops

    free, _, stops = chunk(eos_ids={3, 1}, stop_token_ids=[9, 3], ignore_eos=True)
    assert stops == [-1] * len(stops)  # ignore_eos: the device stops at nothing
    stop = free[1]  # reached by the second step at the latest
    stopped, steps, stops = chunk(eos_ids={stop}, stop_token_ids=[stop + 1, stop])
    assert stopped == free[: free.index(stop) + 1] and steps < 3
    assert stops[:2] == [stop, stop + 1] and stops[2:] == [-1] * (len(stops) - 2)  # EOS first, each once
    assert chunk(stop_token_ids=[stop])[0] == stopped


def test_the_runner_drafts_by_itself_only_with_graphs(tiny_random):
    runner = _tiny_runner(tiny_random)
    assert runner.device_drafter.method == "ngram" and runner.device_drafter.stats().drafts == 0
    mtp = _tiny_runner(tiny_random, profile=NGRAM.overridden(spec="mtp"))
    assert mtp.use_graphs and mtp.device_drafter.method == "mtp"  # the module drafts inside the graphs
    eager = _tiny_runner(tiny_random, profile=NGRAM.overridden(spec="mtp", cuda_graphs=False))
    assert eager.device_drafter is None  # the engine drafts, from each step's hidden states


def test_lookahead_chunks_stay_within_owned_blocks_and_max_tokens(tiny_random):
    runner = _tiny_runner(tiny_random, block_size=8)
    seq = Sequence(list(range(6)), SamplingParams(max_tokens=100))
    seq.block_table, seq.num_computed = list(range(2)), 5
    batch = [ScheduledSeq(seq, 1, 1)]
    assert runner._chunk_steps(batch) == 11  # to the end of the owned blocks
    assert runner._chunk_steps(batch, done=11) == 0  # nothing to queue behind it
    seq.block_table = list(range(8))
    assert runner._chunk_steps(batch) == MAX_DECODE_STEPS
    assert runner._chunk_steps(batch, done=MAX_DECODE_STEPS) == MAX_DECODE_STEPS  # the chunk queued behind
    assert runner._chunk_steps(batch, done=50) == 64 - 5 - 50
    seq.params.max_tokens = 4
    assert runner._chunk_steps(batch) == 4  # no more tokens than the request wants
    assert runner._chunk_steps(batch, done=4) == 0


def test_spec_chunks_take_the_steps_the_wanted_tokens_need_at_the_recent_yield(tiny_random):
    runner = _tiny_runner(tiny_random, block_size=8)
    seqs = [Sequence(list(range(6)), SamplingParams(max_tokens=n)) for n in (100, 10)]
    batch = [ScheduledSeq(s, 1, 1) for s in seqs]
    assert runner._spec_steps(batch) == SPEC_CHUNK_STEPS  # nothing measured: one token a step, a whole chunk
    runner.spec_step_yield = 3.5
    seqs[0].params.max_tokens = 20
    assert runner._spec_steps(batch) == 6  # ceil(20 / 3.5): the sequence wanting the most
    assert runner._spec_steps(batch, ahead=6 * 3.5) == 0  # the chunk before should end it: queue nothing
    seqs[0].token_ids += [1] * 19  # 19 of its 20 tokens out
    assert runner._spec_steps(batch) == 3  # the other one still wants 10


def test_a_bucket_captures_its_decode_and_verify_graphs_together(tiny_random, monkeypatch):
    """The kind chooser may switch kinds mid-request: the second graph must not be captured then (seconds)."""
    captured = []

    def capture(self, key, body, query_rows):
        captured.append((*key, query_rows))
        self.graphs[key] = object()

    monkeypatch.setattr(CudaGraphRunner, "_capture", capture)
    runner = _tiny_runner(tiny_random, block_size=8)
    seq = Sequence(list(range(6)), SamplingParams(max_tokens=100))
    seq.block_table, seq.num_computed = list(range(4)), 5
    runner._ensure_graphs([ScheduledSeq(seq, 1, 1)], 1, True)
    assert captured == [(1, True, "decode", 1), (1, True, "spec", 4), (1, True, "probe", 2)]  # and query rows
    runner._ensure_graphs([ScheduledSeq(seq, 1, 1)], 1, True)
    assert len(captured) == 3  # once
    seq.spec_enabled = False  # a request that opted out: decode graphs only
    runner._ensure_graphs([ScheduledSeq(seq, 1, 1)], 2, True)
    assert captured[3:] == [(2, True, "decode", 1)]
    one_draft = _tiny_runner(tiny_random, block_size=8, profile=NGRAM.overridden(spec_tokens=1))
    seq.spec_enabled = True
    one_draft._ensure_graphs([ScheduledSeq(seq, 1, 1)], 1, True)
    assert captured[4:] == [(1, True, "decode", 1), (1, True, "spec", 2)]  # K = 1: the probe is the spec graph


def test_large_weights_keep_one_route_for_a_graphs_decode_and_verify_rows(tiny_random):
    """Row-invariant graphs give large weights and long int4 rows one route for all their rows: the GEMV in a
    one-sequence graph (decode and verify), the skinny GEMM in larger buckets; long 16-bit and fp8 rows the skinny
    GEMM where verify steps may run, the GEMV in a one-row step where none can; eager steps get one row back."""
    for profile, long_rows in ((NGRAM, 0), (NGRAM.overridden(spec="none"), 1)):
        runner = _tiny_runner(tiny_random, profile=profile)
        kernels = runner.kernels
        seen = {}
        for bucket, query_rows in ((1, 1), (1, 5), (2, 1), (2, 5)):
            with runner.graph_settings(bucket, query_rows):
                assert kernels.row_invariant and kernels.long_gemv_rows == long_rows
                seen[bucket, query_rows] = kernels.large_gemv_rows
        assert seen == {(1, 1): 1, (1, 5): 5, (2, 1): 0, (2, 5): 0}
        assert kernels.large_gemv_rows == LARGE_GEMV_MAX_ROWS and not kernels.row_invariant
        assert kernels.long_gemv_rows == LONG_GEMV_MAX_ROWS


def test_the_faster_kind_of_round_trip_runs_and_the_other_is_retried(tiny_random):
    """A losing spec is retried after 8 round trips, then 16, 32 (the text may turn copyable); a losing decode once
    after 16, then every 128 (its rate does not depend on the text). Rates are kept per batch size."""
    runner = _tiny_runner(tiny_random)
    batch = [ScheduledSeq(Sequence(list(range(6)), SamplingParams()), 1, 1)]
    assert runner._spec_chunk_wanted(batch)  # nothing measured: a spec chunk first
    runner.rates_of(1)["spec"] = 300.0
    assert not runner._spec_chunk_wanted(batch)  # then plain decoding
    runner.rates_of(1)["decode"] = 200.0
    choices = [runner._spec_chunk_wanted(batch) for _ in range(300)]
    assert [i for i, spec in enumerate(choices) if not spec] == [16, 17, 146, 147, 276, 277]  # two round trips each
    runner.rates_of(1)["spec"] = 100.0  # the text stopped copying: decode wins, spec is what gets retried
    choices = [runner._spec_chunk_wanted(batch) for _ in range(60)]
    assert [i for i, spec in enumerate(choices) if spec] == [8, 9, 26, 27]
    assert runner._spec_chunk_wanted(batch * 2)  # batches of two: nothing measured yet, a spec chunk first
    fixed = _tiny_runner(tiny_random, profile=NGRAM.overridden(spec_adaptive=False))
    fixed.rates_of(1).update(spec=100.0, decode=200.0)
    assert all(fixed._spec_chunk_wanted(batch) for _ in range(20))  # not adaptive: always speculate
    assert not runner._spec_possible(batch * (runner.spec_rows + 1))  # past the spec buckets: never, even if asked
    batch[0].seq.spec_enabled = False
    assert not runner._spec_chunk_wanted(batch) and not fixed._spec_chunk_wanted(batch)


def test_copy_yield_replays_the_drafter_over_the_tokens():
    """copy_yield's verify steps keep what NgramDrafter's lookup would have drafted of the tokens that came: the same
    as calling lookup at every step (its no-copy filter skips only positions where lookup finds nothing)."""
    motif = list(range(100, 137))
    assert copy_yield(motif * 4, 73, 4) == 5.0  # all copied: 4 drafts and the next token a step, 15 steps
    assert copy_yield(list(range(200)), 100, 4) == 1.0  # new text: nothing drafted

    def replay(tokens, start, k):
        steps, position = 0, start
        while position < len(tokens):
            drafts, kept = lookup(tokens[:position], k), 0
            while kept < len(drafts) and position + kept < len(tokens) and drafts[kept] == tokens[position + kept]:
                kept += 1
            position, steps = position + kept + 1, steps + 1
        return (len(tokens) - start) / steps

    rng = np.random.default_rng(0)
    for _ in range(200):
        tokens = rng.integers(0, rng.choice([3, 10, 1000]), rng.integers(3, 80)).tolist()
        tokens += tokens[: rng.integers(0, len(tokens))]
        start = int(rng.integers(1, len(tokens)))
        assert copy_yield(tokens, start, 4) == pytest.approx(replay(tokens, start, 4)), (tokens, start)


@pytest.mark.parametrize(
    "copyable,verify_steps_a_second,spec_after", [(True, 125.0, 500.0), (True, 70.0, 150.0), (False, 125.0, 150.0)]
)
def test_a_decode_round_of_copyable_text_hands_over_to_spec_at_once(
    tiny_random, monkeypatch, copyable, verify_steps_a_second, spec_after
):
    """While decode wins, its rounds' tokens are replayed through the drafter: on text each verify step would have
    copied all its drafts of (3 here: 4 tokens a step), what spec would have run at (verify steps a second x tokens
    a step: 500) becomes spec's rate and spec runs next; an estimate under 1.5 x decode (280 < 300) or new text (1
    token a step) leaves the rates and the retry schedule as they were."""
    runner = _tiny_runner(tiny_random)
    history = list(range(100, 137)) * 4 if copyable else list(range(1000, 1148))
    seq = Sequence(history[:-16], SamplingParams(max_tokens=100))
    batch = [ScheduledSeq(seq, 1, 1)]
    runner._spec_chunk_wanted(batch)
    runner.rates_of(1).update(spec=150.0, decode=200.0)  # spec's rounds lost
    runner.verify_step_rates[1] = verify_steps_a_second
    assert not runner._spec_chunk_wanted(batch)
    start = seq.num_computed = len(seq.token_ids) - 1
    seq.token_ids += history[-16:]  # the engine took the decode round's 16 tokens
    seq.num_computed += 16
    runner._ahead = _Lookahead([seq], [start], [np.array(history[-16:])])
    runner._round = ("decode", 0.0, runner.graph_captures)
    monkeypatch.setattr(time, "perf_counter", lambda: 16 / 200.0)
    runner._close_round()
    assert runner.rates_of(1) == {"decode": 200.0, "spec": spec_after}
    assert runner._spec_chunk_wanted(batch) == (spec_after > 200.0)


def test_a_retry_asked_for_while_queueing_runs_and_only_rounds_with_a_chunk_behind_count(tiny_random, monkeypatch):
    """When a spec chunk queues nothing behind it because the chooser wants decode, the next round decodes (the
    chooser is not asked again, which could answer the other way); a round that ended with nothing queued behind
    it leaves the rates alone, one that had a chunk behind it sets its kind's rate."""
    runner = _tiny_runner(tiny_random)
    seq = Sequence(list(range(6)), SamplingParams(max_tokens=100))
    seq.block_table, seq.num_computed = list(range(4)), 5
    batch = [ScheduledSeq(seq, 1, 1)]
    monkeypatch.setattr(
        CudaGraphRunner,
        "_to_host",
        lambda self, tokens, host, meanwhile=None: (meanwhile and meanwhile(), host.copy_(tokens).numpy())[1],
    )
    monkeypatch.setattr(CudaGraphRunner, "_spec_chunk_wanted", lambda self, batch: False)
    runner._read_spec(batch, (1, True, "spec"), 2, [6])  # its queue_next asks the chooser: decode
    assert runner._next_kind == "decode" and runner._in_flight is None
    ran = []
    monkeypatch.setattr(CudaGraphRunner, "_spec_chunk_wanted", lambda self, batch: True)  # asked again: spec
    monkeypatch.setattr(CudaGraphRunner, "_decode", lambda self, batch: ran.append("decode") or torch.zeros(1))
    monkeypatch.setattr(CudaGraphRunner, "_spec_chunk", lambda self, batch: ran.append("spec") or torch.zeros(1))
    runner.run(batch)
    assert ran == ["decode"] and runner._next_kind is None
    runner.run(batch)  # no retry pending: the chooser decides
    assert ran == ["decode", "spec"]

    def round_of(kind):
        runner._ahead = _Lookahead([seq], [seq.num_computed - 4], [np.arange(8)])
        runner._round = (kind, 0.0, runner.graph_captures)

    round_of("decode")
    runner._close_round(counted=False)
    assert runner.rates_of(1) == {"decode": 0.0, "spec": 0.0}
    round_of("decode")
    runner._close_round()
    assert runner.rates_of(1)["decode"] > 0 and runner.rates_of(1)["spec"] == 0.0 and not runner.rates_of(2)["decode"]


def test_a_losing_spec_is_probed_in_the_narrow_graph_until_a_probe_wins(tiny_random, monkeypatch):
    """While decode leads, spec chunks run the probe graph (one draft a verify step, the cheapest round); a probe's
    round sets spec's rate but not the full-width verify-step rate the n-gram estimate reads; a probe that wins
    queues no second probe behind it: the next chunk runs the full-width graph, its inputs laid out afresh."""
    runner = _tiny_runner(tiny_random)
    seq = Sequence(list(range(6)), SamplingParams(max_tokens=100))
    seq.block_table, seq.num_computed = list(range(4)), 5
    batch = [ScheduledSeq(seq, 1, 1)]
    assert runner._spec_kind() == "spec"  # nothing measured yet
    runner.rates_of(1).update(spec=100.0, decode=200.0)
    assert not runner._spec_chunk_wanted(batch) and runner._spec_kind() == "probe"
    runner._ahead = _Lookahead([seq], [seq.num_computed - 4], [np.arange(8)])
    runner._round = ("probe", 0.0, runner.graph_captures)
    monkeypatch.setattr(time, "perf_counter", lambda: 4 / 400.0)  # 4 tokens taken at 400 a second
    runner._close_round()
    assert runner.rates_of(1)["spec"] == 250.0 and runner.verify_step_rates == {}
    queued = []
    monkeypatch.setattr(CudaGraphRunner, "_replay_spec", lambda self, key, steps: queued.append(key))
    monkeypatch.setattr(
        CudaGraphRunner,
        "_to_host",
        lambda self, tokens, host, meanwhile=None: (meanwhile and meanwhile(), host.copy_(tokens).numpy())[1],
    )
    monkeypatch.setattr(CudaGraphRunner, "_spec_chunk_wanted", lambda self, batch: True)
    runner._read_spec(batch, (1, True, "probe"), 2, [6])  # still losing: the retry's second probe is queued
    assert queued == [(1, True, "probe")] and runner._next_kind is None
    runner.spec_winning = True  # the probe won
    runner._read_spec(batch, (1, True, "probe"), 2, [6])
    assert queued == [(1, True, "probe")] and runner._in_flight is None and runner._next_kind == "spec"
    assert runner._spec_kind() == "spec"


@pytest.mark.parametrize(
    "kind,measured,rate",
    [("decode", 400.0, 400.0), ("decode", 100.0, 150.0), ("spec", 400.0, 300.0), ("spec", 100.0, 150.0)],
)
def test_a_faster_decode_round_sets_the_decode_rate_and_anything_else_is_smoothed(
    tiny_random, monkeypatch, kind, measured, rate
):
    """Decode's rate does not depend on the text, so a round slower than it is a host hiccup: it pulls the rate
    halfway, a faster one replaces it. Spec's rate follows the text: halfway both ways."""
    runner = _tiny_runner(tiny_random)
    seq = Sequence(list(range(6)), SamplingParams(max_tokens=100))
    seq.num_computed = 5
    runner.rates_of(1)[kind] = 200.0
    runner._ahead = _Lookahead([seq], [seq.num_computed - 4], [np.arange(8)])  # the engine took 4 of its tokens
    runner._round = (kind, 0.0, runner.graph_captures)
    monkeypatch.setattr(time, "perf_counter", lambda: 4 / measured)
    runner.spec_step_yield = 2.0
    runner._close_round()
    assert runner.rates_of(1)[kind] == pytest.approx(rate)
    # a spec round also gives the verify steps a second (its rate over the tokens a step gave)
    assert runner.verify_step_rates.get(1) == (pytest.approx(rate / 2.0) if kind == "spec" else None)


def test_lookahead_answers_only_the_steps_it_holds(tiny_random):
    runner = _tiny_runner(tiny_random)
    seq = Sequence(list(range(6)), SamplingParams(max_tokens=100))
    seq.num_computed = 5  # the chunk started at position 5 and produced the tokens at positions 6..9
    runner._ahead = _Lookahead([seq], [5], [np.array([50, 51, 52, 53])])
    assert runner._from_lookahead([ScheduledSeq(seq, 1, 1)]).tolist() == [50]  # the chunk's own step
    seq.token_ids += [50, 51]
    seq.num_computed = 7
    assert runner._from_lookahead([ScheduledSeq(seq, 1, 1)]).tolist() == [52]
    seq.token_ids += [52, 53]
    seq.num_computed = 9
    assert runner._from_lookahead([ScheduledSeq(seq, 1, 1)]) is None  # spent
    seq.token_ids[-2] = 7  # position 8 holds another token than the look-ahead sampled there
    seq.num_computed = 8
    assert runner._from_lookahead([ScheduledSeq(seq, 1, 1)]) is None  # not the look-ahead's path any more
    seq.num_computed = 6
    assert runner._from_lookahead([ScheduledSeq(seq, 2, 2)]) is None  # not a decode-shaped row


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int4", "int4-packed"])
def test_verify_graph_gives_the_plain_tokens(precision, monkeypatch):
    """ngram with graphs == none, batch 1 and batched, greedy and seeded, in 16-bit and int4 (x as int8 blocks) too,
    with x handed on packed between GEMVs too (int4-packed): the verify rows run the decode step's row-invariant
    kernels, so near-ties round the same way in both; rows past a step's drafts and a bucket's padding row are
    skipped without changing a live row."""
    import flashnext.plugins.cuda.launch as launch_module
    from flashnext.core.llm import LLM

    if precision == "int4-packed":
        precision = "int4"
        monkeypatch.setattr(launch_module, "PACKED_X_MIN_K", 0)  # SmolLM2's rows are short

    loaded = random_model("smollm2-135m", torch.device("cuda"))
    motifs = torch.randint(0, 49152, (3, 12), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [(m * 4)[: 40 + 3 * i] for i, m in enumerate(motifs)]  # repeats: the random model copies them
    outputs, engines = {}, {}
    for spec in ("none", "ngram"):
        llm = LLM(
            model=loaded,
            backend="cuda",
            precision=precision,
            profile="full",
            spec=spec,
            spec_tokens=4,
            max_model_len=256,
            max_num_seqs=4,
        )
        for temperature in (0.0, 0.9):
            params = SamplingParams(temperature=temperature, max_tokens=48, ignore_eos=True, seed=5)
            outputs[spec, temperature, 1] = [s.output_ids for s in llm.engine.generate(prompts[:1], params)]
            outputs[spec, temperature, 3] = [s.output_ids for s in llm.engine.generate(prompts, params)]
        engines[spec] = llm.engine
    stats = engines["ngram"].spec_stats()  # the runner's own: spec chunks, verify steps chained on the device
    assert stats["drafts"] > 0 and stats["accepted"] > 0
    for key in [k for k in outputs if k[0] == "ngram"]:
        assert outputs[key] == outputs[("none",) + key[1:]], key


def test_verify_rows_through_the_gemv_match_one_row_decode():
    """A small verify step's projections run as the decode GEMV: each row exactly as a one-row step computes it."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).to(DEV)
    w = torch.randn(96, 64, generator=gen).to(DEV)
    kernels = CudaKernels()
    kernels.gemv_max_rows = 5
    rows = kernels.linear(x, w)
    assert all(torch.equal(rows[i], kernels.linear(x[i : i + 1], w)[0]) for i in range(5))
    assert torch.allclose(rows, x @ w.T, rtol=1e-4, atol=1e-4)


class _EagerGraph:
    """Stands in for a captured CUDA graph on the CPU: replay runs the body with the capture-time settings."""

    def __init__(self, runner, key, body, query_rows):
        self.runner, self.key, self.body, self.query_rows = runner, key, body, query_rows

    def replay(self):
        with self.runner.graph_settings(self.key[0], self.query_rows):
            self.body()


class CpuCuda(CudaBackend):
    """The CUDA backend with its tensors on the CPU."""

    def device(self):
        return torch.device("cpu")

    def free_memory_bytes(self):
        return 1 << 28

    def peak_memory_bytes(self, run):
        run()
        return 0


def run_graphs_eagerly(monkeypatch) -> None:
    """On the CPU: a captured graph's body runs at each replay, and its tokens are on the host at once."""

    def capture(self, key, body, query_rows):
        self.graphs[key] = _EagerGraph(self, key, body, query_rows)
        self.graph_captures += 1
        return self.graphs[key]

    def to_host(self, tokens, host, meanwhile=None):  # eager "graphs" have already run: no wait
        host.copy_(tokens)
        if meanwhile is not None:
            meanwhile()
        return host.numpy()

    monkeypatch.setattr(CudaGraphRunner, "_capture", capture)
    monkeypatch.setattr(CudaGraphRunner, "_to_host", to_host)


@pytest.fixture
def cuda_engine_on_cpu(monkeypatch, tiny_random):
    """LLMEngines running the whole CUDA runner (decode look-ahead, verify, spec chunks) on the CPU, graphs eager;
    on a GPU machine, the real thing."""
    from flashnext.core.engine.engine import LLMEngine

    def make(**settings):
        backend = CudaBackend() if torch.cuda.is_available() else CpuCuda()
        profile = backend.profiles()["full"].overridden(max_model_len=256, max_num_seqs=4, **settings)
        return LLMEngine(backend, tiny_random, "fp32", profile)

    if not torch.cuda.is_available():
        run_graphs_eagerly(monkeypatch)
    return make


@pytest.mark.slow
def test_engine_with_spec_chunks_gives_the_plain_tokens(cuda_engine_on_cpu, monkeypatch):
    """The whole CUDA speculative path through the engine (device chunks, the chunk queued behind the one read,
    the engine's block reserve, look-ahead consumption, chunk limits at max_tokens, the kind chooser) gives
    --spec none's tokens for a batch. Small: the interpreter takes about a second a step."""
    import flashnext.plugins.cuda.runner as runner_module

    served = []
    continue_in_flight = CudaGraphRunner._continue_in_flight
    monkeypatch.setattr(
        CudaGraphRunner,
        "_continue_in_flight",
        lambda self, batch: served.append(self._in_flight[0]) or continue_in_flight(self, batch),
    )
    motifs = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(2)).tolist()
    prompts = [(m * 5)[: 30 + 4 * i] for i, m in enumerate(motifs)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [s.output_ids for s in cuda_engine_on_cpu(spec="none").generate(prompts, params)]
    monkeypatch.setattr(runner_module, "SPEC_CHUNK_STEPS", 2)  # short chunks: several per request, queued ahead
    spec = cuda_engine_on_cpu(spec="ngram", spec_tokens=4)
    served.clear()
    assert [s.output_ids for s in spec.generate(prompts, params)] == want
    assert spec.spec_stats()["drafts"] > 0 and spec.spec_stats()["accepted"] > 0
    assert "spec" in served  # tokens came from spec chunks queued behind the one read


@pytest.mark.slow
def test_decode_chunks_queued_ahead_give_the_step_by_step_tokens(cuda_engine_on_cpu, monkeypatch):
    """Plain decoding with the next chunk queued behind the one the engine reads: requests that finish mid-chunk
    and one that arrives late (the chunk in flight is dropped each time the batch changes) get exactly the tokens
    of one step a round trip with nothing queued, and queued chunks did serve tokens (block tables growing
    meanwhile)."""
    served = []
    continue_in_flight = CudaGraphRunner._continue_in_flight
    monkeypatch.setattr(
        CudaGraphRunner,
        "_continue_in_flight",
        lambda self, batch: served.append(len(batch)) or continue_in_flight(self, batch),
    )
    prompts = torch.randint(0, 300, (3, 7), generator=torch.Generator().manual_seed(4)).tolist()
    lengths = [9, 4, 6]

    def run(engine, chunk_steps):
        # Few slots kept ahead: the block tables grow under the chunks queued ahead (which must see that).
        engine.runner.max_decode_steps, engine.runner.lookahead_tokens = chunk_steps, 2 * chunk_steps
        seqs = [
            engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts[:2], lengths)
        ]
        for _ in range(2):
            engine.step()
        seqs.append(engine.add_request(prompts[2], SamplingParams(max_tokens=lengths[2], ignore_eos=True)))
        while engine.has_work():
            engine.step()
        return [s.output_ids for s in seqs]

    step_by_step = cuda_engine_on_cpu(spec="none")
    chunk_steps = step_by_step.runner._chunk_steps
    step_by_step.runner._chunk_steps = lambda batch, done=0: 0 if done else chunk_steps(batch)  # nothing queued
    want = run(step_by_step, 1)
    assert not served and [len(t) for t in want] == lengths
    assert run(cuda_engine_on_cpu(spec="none"), 3) == want
    assert served  # tokens came from chunks queued ahead
