"""MTP drafting inside the CUDA runner's graphs: lossless against --spec none and the module's device cache against
a from-scratch run (CPU, Triton interpreter, graph bodies run eagerly); on a GPU, the captured graphs themselves."""

import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is a test dependency (pip install triton)")

from flashnext.core.cli_bench import with_mtp_module  # noqa: E402
from flashnext.core.engine.engine import LLMEngine  # noqa: E402
from flashnext.core.engine.scheduler import ScheduledSeq  # noqa: E402
from flashnext.core.engine.sequence import SamplingParams, Sequence  # noqa: E402
from flashnext.core.metrics import ServerMetrics  # noqa: E402
from flashnext.core.precision import Fp8Weight  # noqa: E402
from flashnext.plugins.cuda import CudaBackend  # noqa: E402
from flashnext.plugins.cuda.mtp_graphs import WARM_CATCH_UP_ROWS, MtpTracker, draft_head  # noqa: E402
from flashnext.plugins.cuda.runner import CudaGraphRunner  # noqa: E402
from test_cuda_spec import CpuCuda, run_graphs_eagerly  # noqa: E402

PROMPTS = [[5, 9, 14, 3, 8, 21, 7, 40, 2, 11, 60], [17, 4, 4, 90, 31, 6, 250, 8, 12]]


@pytest.fixture
def mtp_engine(monkeypatch):
    """LLMEngines running the CUDA runner with MTP on the CPU (graph bodies eager, as in test_cuda_spec.py); on a
    GPU machine, the real thing."""

    def make(loaded, precision="fp32", **settings):
        backend = CudaBackend() if torch.cuda.is_available() else CpuCuda()
        settings = {
            "max_model_len": 256,
            "max_num_seqs": 4,
            "max_num_batched_tokens": 32,
            "kv_cache_max_gib": 0.25,
        } | settings
        profile = backend.profiles()["full"].overridden(**settings)
        return LLMEngine(backend, loaded, precision, profile)

    if not torch.cuda.is_available():
        run_graphs_eagerly(monkeypatch)
    return make


def generate(engine, prompts, params):
    return [s.output_ids for s in engine.generate(prompts, params)]


@pytest.mark.slow
@pytest.mark.parametrize("copying", [True, False], ids=["accepting", "rejecting"])
def test_mtp_in_the_graphs_gives_the_plain_tokens(tiny_random, mtp_engine, copying):
    """Greedy --spec mtp through the CUDA runner (drafts, verify, verdicts and catch-ups in the graph bodies, prompt
    chunks caught up chunk by chunk) gives --spec none's tokens for a batch, with a module whose drafts the target
    accepts (every draft position, so the chained steps draft right) and with a random one whose drafts it rejects.
    Small: the interpreter takes tens of seconds a verify step."""
    loaded = with_mtp_module(tiny_random, copying=copying)
    params = SamplingParams(temperature=0.0, max_tokens=8 if copying else 4, ignore_eos=True)
    want = generate(mtp_engine(loaded, spec="none"), PROMPTS, params)
    engine = mtp_engine(loaded, spec="mtp", spec_tokens=3, spec_adaptive=False, max_num_batched_tokens=16)
    assert generate(engine, PROMPTS, params) == want
    stats, runner = engine.spec_stats(), engine.runner.stats()
    assert runner.spec_path == "graphs" and runner.spec_graph_steps > 0 and stats["drafts"] > 0
    if copying:
        assert stats["accepted"] > stats["drafted"] / 2 and all(stats["accepted_per_position"])
    else:
        assert stats["accepted"] < stats["drafted"] / 2


@pytest.mark.slow
def test_probes_run_the_one_draft_graph_and_keep_the_plain_tokens_and_the_modules_cache(tiny_random, mtp_engine):
    """While decode chunks lead, the chooser's spec retries run the probe graph (two verify rows a sequence, one
    draft) of a K = 3 engine: its drafts, verdicts and catch-ups give --spec none's tokens, only the first draft
    position is ever verified, and the module's cache equals a from-scratch run's."""
    loaded = with_mtp_module(tiny_random, copying=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    [want] = generate(mtp_engine(loaded, spec="none"), PROMPTS[:1], params)
    engine = mtp_engine(loaded, spec="mtp", spec_tokens=3, spec_adaptive=False)
    runner = engine.runner
    runner.spec_winning = False  # decode leads: every spec chunk is a probe (fixed K asks for spec every round)
    ran = []
    replay = runner._replay_spec
    runner._replay_spec = lambda key, steps: ran.append(key[2]) or replay(key, steps)
    seq = engine.add_request(PROMPTS[0], params)
    while len(seq.output_ids) < 5:
        engine.step()
    kept, bs = seq.num_computed, engine.blocks.block_size
    fresh = mtp_engine(loaded, spec="mtp", spec_tokens=3, spec_adaptive=False, cuda_graphs=False)
    again = fresh.add_request(seq.token_ids[:kept], SamplingParams(max_tokens=4, ignore_eos=True))
    fresh.step()

    def slots(s):
        return torch.tensor([s.block_table[p // bs] * bs + p % bs for p in range(kept)])

    device = runner.device_drafter
    for device_cache, host_cache in zip(device.caches, (fresh.spec.drafter.k_cache, fresh.spec.drafter.v_cache)):
        torch.testing.assert_close(device_cache.flatten(0, 1)[slots(seq)], host_cache.flatten(0, 1)[slots(again)])
    while engine.has_work():
        engine.step()
    assert seq.output_ids == want and set(ran) == {"probe"}
    stats = engine.spec_stats()
    assert stats["accepted"] > 0 and stats["drafted"] == stats["drafts"]  # one draft a step
    assert stats["accepted_per_position"][1:] == [0, 0]


@pytest.mark.slow
def test_seeded_mtp_sampling_in_the_graphs_is_plain_sampling(tiny_random, mtp_engine):
    """Seeded sampling through the verify rows' sampler: --spec none's tokens. A low temperature, as the copying
    module's greedy drafts are otherwise mostly rejected by the tiny model's flat distribution."""
    loaded = with_mtp_module(tiny_random, copying=True)
    params = SamplingParams(temperature=0.05, max_tokens=6, ignore_eos=True, seed=3)
    want = generate(mtp_engine(loaded, spec="none"), PROMPTS[:1], params)
    engine = mtp_engine(loaded, spec="mtp", spec_tokens=2, spec_adaptive=False)
    assert generate(engine, PROMPTS[:1], params) == want
    assert engine.spec_stats()["accepted"] > 0


@pytest.mark.slow
def test_the_device_cache_holds_what_a_from_scratch_run_computes(tiny_random, mtp_engine):
    """After prompt chunks, decode and verify rounds, the module's KV at each kept position, and its first draft,
    equal what the host drafter computes over the whole sequence at once."""
    loaded = with_mtp_module(tiny_random)
    engine = mtp_engine(loaded, spec="mtp", spec_tokens=2, spec_adaptive=False, max_num_batched_tokens=16)
    seq = engine.add_request(PROMPTS[0] * 2, SamplingParams(max_tokens=40, ignore_eos=True))  # in two chunks
    while len(seq.output_ids) < 6:
        engine.step()
    kept, bs = seq.num_computed, engine.blocks.block_size  # positions 0 .. kept - 1, each with its next token
    fresh = mtp_engine(loaded, spec="mtp", spec_tokens=2, spec_adaptive=False, cuda_graphs=False)
    again = fresh.add_request(seq.token_ids[:kept], SamplingParams(max_tokens=4, ignore_eos=True))
    fresh.step()  # the prompt, then the host drafter's catch-up over all of it and its drafts
    assert again.token_ids == seq.token_ids[: kept + 1]

    def slots(s):
        return torch.tensor([s.block_table[p // bs] * bs + p % bs for p in range(kept)])

    device, host = engine.runner.device_drafter, fresh.spec.drafter
    for device_cache, host_cache in zip(device.caches, (host.k_cache, host.v_cache)):
        torch.testing.assert_close(device_cache.flatten(0, 1)[slots(seq)], host_cache.flatten(0, 1)[slots(again)])
    state = device.states[slots(seq)[-1:]]
    assert first_draft(device, state) == again.draft_ids[:1]


def first_draft(device, state) -> list[int]:
    """The device drafter's greedy draft from a chained state (one live row)."""
    column = torch.zeros(device.k + 1, dtype=torch.int64, device=state.device)
    live = torch.ones(1, dtype=torch.int32, device=state.device)
    return device._greedy(device.mtp.head_input(device.kernels, state), live, column, device.k).tolist()


@pytest.mark.slow
def test_decode_steps_leave_the_module_out_and_the_next_spec_chunk_catches_it_up(tiny_random, mtp_engine):
    """Decode chunks keep the target's final states and run no module step (its cache stays unwritten there); the
    spec chunk after them first catches the module up over those positions in one step, so its cache and first
    draft equal a from-scratch run's, and the output stays --spec none's."""
    loaded = with_mtp_module(tiny_random)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    [want] = generate(mtp_engine(loaded, spec="none"), PROMPTS[:1], params)
    engine = mtp_engine(loaded, spec="mtp", spec_tokens=2, spec_adaptive=False)
    runner, device = engine.runner, engine.runner.device_drafter
    runner.max_decode_steps = 2  # short decode chunks: the interpreter is slow
    decode_only = True
    runner._spec_possible = lambda batch: not decode_only and CudaGraphRunner._spec_possible(runner, batch)
    seq = engine.add_request(PROMPTS[0], params)
    bs, prompt = engine.blocks.block_size, len(PROMPTS[0])

    def slots(s, n):
        return torch.tensor([s.block_table[p // bs] * bs + p % bs for p in range(n)])

    while len(seq.output_ids) < 5:
        engine.step()
    assert seq.spec_tracker.behind == prompt  # decode chunks from the first token after the prompt on
    left_out = slots(seq, seq.num_computed)[prompt:]
    assert not device.caches[0].flatten(0, 1)[left_out].any()
    decode_only = False
    while seq.spec_tracker.behind is not None or not device.totals[0]:
        engine.step()
    kept = seq.num_computed
    fresh = mtp_engine(loaded, spec="mtp", spec_tokens=2, spec_adaptive=False, cuda_graphs=False)
    again = fresh.add_request(seq.token_ids[:kept], SamplingParams(max_tokens=4, ignore_eos=True))
    fresh.step()
    for device_cache, host_cache in zip(device.caches, (fresh.spec.drafter.k_cache, fresh.spec.drafter.v_cache)):
        torch.testing.assert_close(
            device_cache.flatten(0, 1)[slots(seq, kept)], host_cache.flatten(0, 1)[slots(again, kept)]
        )
    assert first_draft(device, device.states[slots(seq, kept)[-1:]]) == again.draft_ids[:1]
    while engine.has_work():
        engine.step()
    assert seq.output_ids == want


def test_mtp_metrics_name_the_graph_path(tiny_random, mtp_engine):
    """/metrics reads the runner's stats(): the method, the path speculation runs on and its verify steps there."""
    engine = mtp_engine(with_mtp_module(tiny_random), spec="mtp", spec_tokens=2)
    engine.runner.device_drafter.totals[0] = 5  # verify steps the spec chunks counted
    text = ServerMetrics(engine).render().decode()
    assert 'flashnext_spec_decode_path_info{method="mtp",path="graphs"} 1.0' in text
    assert engine.runner.stats().spec_graph_steps == 5 and "flashnext_spec_decode_graph_steps_total 5.0" in text
    eager = mtp_engine(with_mtp_module(tiny_random), spec="mtp", spec_tokens=2, cuda_graphs=False)
    assert 'path="engine"' in ServerMetrics(eager).render().decode()


def test_mtp_rows_stop_drafting_while_their_drafts_fail(tiny_random, mtp_engine):
    """Adaptive mode per request over spec chunks: a row whose drafts keep failing takes none in its next chunks
    (its verify steps then skip the module's heads and chained steps), and K shrinks first; fixed K never pauses."""
    for adaptive, limits in ((True, [3, 2, 0]), (False, [3, 3, 3])):
        engine = mtp_engine(with_mtp_module(tiny_random), spec="mtp", spec_tokens=3, spec_adaptive=adaptive)
        drafter = engine.runner.device_drafter
        batch = [ScheduledSeq(Sequence([5, 9, 14], SamplingParams()), 1, 1)]
        seen = []
        for _ in range(3):
            drafter.before_chunk(batch)
            seen.append(int(drafter.limit[0]))
            drafter.after_chunk(batch, [[8, 8, 24, 0, 0, 0, 0]])  # 8 verify steps, 24 drafts, none accepted
        assert seen == limits


def test_a_request_keeps_its_acceptance_through_chunks_it_is_not_in(tiny_random, mtp_engine):
    """A request's adaptive state lives on the request (seq.spec_tracker, gone with it): paused by failed drafts,
    it stays paused after a chunk of another batch, and each request keeps its own K."""
    engine = mtp_engine(with_mtp_module(tiny_random), spec="mtp", spec_tokens=3)
    drafter = engine.runner.device_drafter
    failing, fine = (ScheduledSeq(Sequence([5, 9, 14], SamplingParams()), 1, 1) for _ in range(2))
    for _ in range(2):
        drafter.before_chunk([failing, fine])
        drafter.after_chunk([failing, fine], [[8, 8, 24, 0, 0, 0, 0], [8, 8, 24, 24, 8, 8, 8]])
    drafter.before_chunk([fine])
    drafter.before_chunk([failing, fine])
    assert drafter.limit[:2].tolist() == [0, 3]
    assert isinstance(failing.seq.spec_tracker, MtpTracker) and failing.seq.spec_tracker.pause_left > 0


def test_the_catch_up_warm_up_writes_nothing(tiny_random, mtp_engine):
    """The eager catch-up run once at several row counts when the spec graphs are first captured (its kernels' first
    uses out of the requests' way) leaves the module's cache and states as they were."""
    engine = mtp_engine(with_mtp_module(tiny_random), spec="mtp", spec_tokens=2)
    drafter = engine.runner.device_drafter
    for tensor in (*drafter.caches, drafter.states):
        tensor.normal_()
    before = [t.clone() for t in (*drafter.caches, drafter.states)]
    ran = []
    forward = drafter._forward
    drafter._forward = lambda ids, *args: ran.append(ids.shape[0]) or forward(ids, *args)
    drafter.warm_up()
    assert ran == [n for n in WARM_CATCH_UP_ROWS if n <= 256]  # max_model_len 256
    assert all(torch.equal(a, b) for a, b in zip(before, (*drafter.caches, drafter.states)))


def test_the_fp8_draft_head_is_a_copy_of_a_16_bit_head_only(tiny_random):
    """spec_draft_head=fp8 (the CUDA full profile's): drafts read an fp8-e4m3 copy (a scale a row) of a 16-bit
    head; an fp32 or already quantized head is read as it is."""
    model = types.SimpleNamespace(lm_head=torch.randn(64, 32).bfloat16())
    copy = draft_head(model, "fp8")
    assert isinstance(copy, Fp8Weight) and copy.fmt == "fp8-e4m3" and copy.scale.shape == (64, 1)
    torch.testing.assert_close(copy.dequantize(torch.float32), model.lm_head.float(), rtol=0.07, atol=1e-3)
    assert draft_head(model, "target") is model.lm_head
    fp32 = types.SimpleNamespace(lm_head=torch.randn(64, 32))
    assert draft_head(fp32, "fp8") is fp32.lm_head
    assert CudaBackend().profiles()["full"].spec_draft_head == "fp8"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize(
    "precision,head", [("fp32", "target"), ("bf16", "target"), ("int4", "target"), ("bf16", "fp8")]
)
def test_mtp_graphs_give_the_plain_tokens(precision, head):
    """--spec mtp with captured graphs == --spec none, batch 1 and batched, greedy and seeded, fixed K and adaptive,
    prompts in chunks, with drafts accepted (the copying module) and rejected (a random one): the verify rows run
    the decode step's row-invariant kernels, and the module's work never touches the target's numbers. Also with
    the drafts read through an fp8 copy of the head (they stay mostly accepted)."""
    from flashnext.core.cli_bench import random_model
    from flashnext.core.llm import LLM

    base = random_model("smollm2-135m", torch.device("cuda"))
    prompts = torch.randint(0, 49152, (3, 48), generator=torch.Generator().manual_seed(0)).tolist()
    for copying in (True, False):
        loaded = with_mtp_module(base, copying=copying)
        outputs, engines = {}, {}
        for spec, adaptive in (("none", True), ("mtp", False), ("mtp", True)):
            llm = LLM(
                model=loaded,
                backend="cuda",
                precision=precision,
                profile="full",
                spec=spec,
                spec_tokens=3,
                spec_adaptive=adaptive,
                spec_draft_head=head,
                max_model_len=256,
                max_num_seqs=4,
                max_num_batched_tokens=32,
                kv_cache_max_gib=1.0,
            )
            for temperature in (0.0, 0.9):
                params = SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True, seed=5)
                outputs[spec, adaptive, temperature, 1] = generate(llm.engine, prompts[:1], params)
                outputs[spec, adaptive, temperature, 3] = generate(llm.engine, prompts, params)
            engines[spec, adaptive] = llm.engine
        fixed = engines["mtp", False]
        stats = fixed.spec_stats()
        assert fixed.runner.stats().spec_path == "graphs" and stats["drafts"] > 0
        assert (stats["accepted"] > stats["drafted"] / 2) if copying else (stats["accepted"] < stats["drafted"] / 2)
        for key in [k for k in outputs if k[0] == "mtp"]:
            assert outputs[key] == outputs[("none", True) + key[2:]], (copying, key)
