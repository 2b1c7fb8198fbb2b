"""Int4 decode steps through the onnxruntime graph against the torch path: numerics, batches, threads, the switch."""

import pytest
import torch

from flashnext.core.engine.engine import LLMEngine
from flashnext.core.engine.scheduler import ScheduledSeq
from flashnext.core.engine.sequence import SamplingParams, Sequence
from flashnext.core.errors import UserError
from flashnext.core.llm import resolve_profile
from flashnext.core.loader import load_model
from flashnext.plugins.cpu import CpuBackend, int4_decode_fact

pytest.importorskip("onnxruntime")


def engine_for(loaded, route: str, precision: str = "int4", **overrides) -> LLMEngine:
    backend = CpuBackend()
    profile = backend.profiles()["full"].overridden(
        int4_decode=route, kv_cache_max_gib=0.02, prefix_caching=False, **overrides
    )
    return LLMEngine(backend, loaded, precision, profile)


def step_logits(engine: LLMEngine, prompts: list[list[int]], steps: int, forced=None) -> list[torch.Tensor]:
    """Logits [B, vocab] of each prompt's last position, then of `steps` decode steps of the whole batch. The token
    fed back after step i is forced[i][b] where given (so two routes see the same inputs), else the greedy one."""
    seqs = [Sequence(list(p), SamplingParams()) for p in prompts]
    last = []
    for seq in seqs:
        engine.blocks.grow(seq, len(seq.token_ids) + steps)
        last.append(engine.runner.run([ScheduledSeq(seq, len(seq.token_ids), 1)])[0][-1])
        seq.num_computed = len(seq.token_ids)
    out = [torch.stack(last)]
    for step in range(steps):
        for i, seq in enumerate(seqs):
            seq.token_ids.append(forced[step][i] if forced else int(out[-1][i].argmax()))
            seq.num_computed = len(seq.token_ids) - 1
        out.append(engine.runner.run([ScheduledSeq(seq, 1, 1) for seq in seqs])[0])
    for seq in seqs:
        engine.blocks.free_sequence(seq)
    return out


def greedy(logits: list[torch.Tensor]) -> list[list[int]]:
    return [step.argmax(-1).tolist() for step in logits]


def nmse(out, ref) -> float:
    return ((out - ref) ** 2).mean().item() / (ref**2).mean().item()


# Decode logits against the torch route's: float32 activations at the reference's rounding; int8 ones (blocks of the
# group size) at what that rounding adds on these random models, past the suite's 1e-3 int4 engine bound.
BOUNDS = {"onnxruntime": 1e-5, "onnxruntime-int8": 4e-3}


def compare_routes(loaded, prompts, route="onnxruntime", steps=4, bound=None):
    """An onnxruntime route's decode logits against the torch route's, step by step on the same tokens."""
    bound = bound or BOUNDS[route]
    ref = step_logits(engine_for(loaded, "torch"), prompts, steps)
    engine = engine_for(loaded, route)
    assert engine.runner.route == route
    got = step_logits(engine, prompts, steps, forced=greedy(ref))
    assert engine.runner.decoder is not None  # the steps really ran through the graph
    assert torch.equal(got[0], ref[0])  # prefill is the torch path on both
    for a, b in zip(got[1:], ref[1:]):
        assert torch.isfinite(a).all()
        assert 0 < nmse(a, b) < bound, f"NMSE {nmse(a, b):.2e}"
    return got


@pytest.fixture(scope="module")
def q4_1_llama(tmp_path_factory):
    from fixtures import write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("q41") / "tiny.gguf", qtype="Q4_1")
    return load_model(str(path))


@pytest.mark.parametrize("route", BOUNDS)
def test_asymmetric_q4_1_codes_decode_near_the_torch_route(q4_1_llama, route):
    # Q4_1 groups carry an offset: the codes run with zero point 0 plus the dense offset term.
    compare_routes(q4_1_llama, [[5, 6, 7, 8, 9, 10, 11]], route)


@pytest.mark.parametrize("route", BOUNDS)
def test_symmetric_int4_with_qk_norm_decodes_near_the_torch_route(tiny_qwen3, route):
    compare_routes(load_model(str(tiny_qwen3)), [list(range(3, 20))], route)


def test_whatever_the_cache_held_past_a_sequences_end_does_not_leak_in(q4_1_llama):
    clean = step_logits(engine_for(q4_1_llama, "onnxruntime"), [[5, 6, 7]], 2)
    engine = engine_for(q4_1_llama, "onnxruntime")
    engine.runner.k_cache.fill_(float("nan"))  # memory the allocator handed over holds anything
    engine.runner.v_cache.fill_(float("nan"))
    dirty = step_logits(engine, [[5, 6, 7]], 2, forced=greedy(clean))
    for a, b in zip(dirty, clean):
        assert torch.equal(a, b)


def test_a_batch_of_different_lengths_decodes_like_each_sequence_alone(q4_1_llama):
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]  # one, two and three blocks of 16
    together = compare_routes(q4_1_llama, prompts, steps=3)
    engine = engine_for(q4_1_llama, "onnxruntime")
    for i, prompt in enumerate(prompts):
        alone = step_logits(engine, [prompt], 3, forced=[[t[i]] for t in greedy(together)])
        for a, b in zip(alone[1:], together[1:]):
            assert nmse(a[0], b[i]) < 1e-5


def test_the_graph_runs_on_the_engines_thread_count_and_pool_setting(q4_1_llama):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        engine = engine_for(q4_1_llama, "onnxruntime")
        step_logits(engine, [[5, 6, 7]], 1)
        options = engine.runner.decoder.session.get_session_options()
        assert options.intra_op_num_threads == 1
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_default_model_decodes_the_torch_routes_greedy_tokens():
    loaded = load_model(None)
    prompts = [loaded.tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):", "Once upon a")]
    compare_routes(loaded, prompts[:1], "onnxruntime", steps=4)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.output_ids for o in engine_for(loaded, "torch").generate(prompts, params)]
    for route in BOUNDS:
        assert [o.output_ids for o in engine_for(loaded, route).generate(prompts, params)] == want, route


def test_auto_picks_onnxruntime_for_int4_and_torch_for_other_precisions(q4_1_llama):
    assert engine_for(q4_1_llama, "auto").runner.route == "onnxruntime"
    assert "onnxruntime" in int4_decode_fact()
    fp32 = engine_for(q4_1_llama, "auto", precision="fp32").runner
    assert fp32.route == "torch" and "not int4" in fp32.route_reason
    assert engine_for(q4_1_llama, "torch").runner.route == "torch"


def test_batch_invariance_keeps_decode_on_the_torch_route(q4_1_llama):
    """onnxruntime's GEMM blocking follows the row count, so a batch-invariant engine decodes through torch, and an
    explicit onnxruntime route is refused with the reason."""
    runner = engine_for(q4_1_llama, "auto", batch_invariant=True).runner
    assert runner.route == "torch" and "batch_invariant" in runner.route_reason
    with pytest.raises(UserError, match="int4_decode = onnxruntime cannot run this model: batch_invariant"):
        engine_for(q4_1_llama, "onnxruntime", batch_invariant=True)


def test_asking_for_onnxruntime_where_it_cannot_run_names_the_reason(q4_1_llama):
    with pytest.raises(UserError, match="int4_decode = onnxruntime cannot run this model: the projections are not"):
        engine_for(q4_1_llama, "onnxruntime", precision="fp32")


def test_the_route_is_an_env_setting(monkeypatch):
    monkeypatch.setenv("FLASHNEXT_INT4_DECODE", "torch")
    assert resolve_profile(CpuBackend(), None, {}).int4_decode == "torch"
    monkeypatch.setenv("FLASHNEXT_INT4_DECODE", "fast")
    with pytest.raises(UserError, match="int4_decode"):
        resolve_profile(CpuBackend(), None, {})
