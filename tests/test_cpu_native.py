"""The C step (plugins/cpu/decode.c) against the exact float32 model: prompt chunks and decode steps on every vector
width, batches, threads, both KV cache types, the LM head's two forms, the build and its fallbacks."""

import platform

import numpy as np
import pytest
import torch

from flashnext.core.errors import UserError
from flashnext.core.loader import load_model
from flashnext.core.precision import Int4Weight, pack_int4
from flashnext.plugins.cpu import kernels as cpu_kernels
from flashnext.plugins.cpu import native
from flashnext.plugins.cpu import runner as cpu_runner
from numerics import step_logits
from test_cpu_ort_graph import engine_for, greedy, nmse

# Decode logits of the C step against the float32 model (the same weights, widened once): the same float32
# arithmetic but for the summation order (observed on these models: below 1e-12; the onnxruntime graph's fp32 route
# is at 1e-6-1e-4 for its 8-bit head).
EXACT = 1e-9


@pytest.fixture(scope="module")
def q4_1_llama(tmp_path_factory):
    from fixtures import write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("q41n") / "tiny.gguf", qtype="Q4_1", head_qtype="Q8_0")
    return load_model(str(path))


@pytest.fixture(scope="module")
def f32_head_llama(tmp_path_factory):
    from fixtures import write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("q41f") / "tiny.gguf", qtype="Q4_1")
    return load_model(str(path))


def float32_reference(loaded, run, kv_cache_dtype="fp16"):
    """run(engine) on the float32 model: the torch route with its int4 weights widened to float32 (instead of its
    float16), so exactly the values the C step computes from, and the keys and values stored as the C step's are
    (float16 by default: the cache `auto` gives it)."""
    with pytest.MonkeyPatch.context() as patch:
        for module in (cpu_kernels, cpu_runner):  # the widened projections and the head's copy
            patch.setattr(module, "EXPANDED_DTYPE", torch.float32)
        return run(engine_for(loaded, "torch", kv_cache_dtype=kv_cache_dtype))


def against_fp32(loaded, prompts, steps=5, library=None, threads=None, kv_cache_dtype="fp16", **settings):
    """(C step's logits, the float32 model's): each prompt's last position, then `steps` decode steps of the batch
    on the same tokens."""
    exact = float32_reference(loaded, lambda engine: step_logits(engine, prompts, steps), kv_cache_dtype)
    engine = engine_for(loaded, "native", **settings)
    assert engine.runner.route == "native" and engine.kv_dtype == torch.float16  # what auto gives the C step
    if kv_cache_dtype != "fp16":
        engine = engine_for(loaded, "native", kv_cache_dtype=kv_cache_dtype, **settings)
    model = engine.runner._native_model()
    if library is not None:
        model.lib = library
    if threads is not None:
        model.team = native.TeamSize(threads)
    calls = []
    step = model.step
    model.step = lambda *a: calls.append(len(a[3])) or step(*a)
    got = step_logits(engine, prompts, steps, forced=greedy(exact))
    # The prompts in calls of up to MAX_TOKENS tokens, then every decode step in one call for the whole batch.
    prefill = [min(native.MAX_TOKENS, len(p) - a) for p in prompts for a in range(0, len(p), native.MAX_TOKENS)]
    assert calls == prefill + [len(prompts)] * steps, calls
    return got, exact


def test_decode_is_the_float32_models_on_asymmetric_q4_1_codes(q4_1_llama):
    got, exact = against_fp32(q4_1_llama, [[5, 6, 7, 8, 9, 10, 11]])
    for a, b in zip(got, exact):
        assert nmse(a, b) < EXACT, nmse(a, b)


def test_decode_is_the_float32_models_with_qk_norm_and_fp32_scales(tiny_qwen3):
    # The checkpoint's float32 head is not its 8-bit codes: the top logits are refined, the rest within its rounding.
    got, exact = against_fp32(load_model(str(tiny_qwen3)), [list(range(3, 20))])
    for a, b in zip(got, exact):
        top = a.topk(4, dim=-1).indices
        assert (a.gather(-1, top) - b.gather(-1, top)).abs().max() < 1e-5
        assert nmse(a, b) < 1e-4, nmse(a, b)


def test_a_batch_of_different_lengths_decodes_as_the_float32_model(q4_1_llama):
    # Several rows take the multi-token kernels (each group's values widened once for every row).
    got, exact = against_fp32(q4_1_llama, [[5, 6, 7, 8, 9, 10, 11], [3, 5], list(range(4, 40))])
    for a, b in zip(got, exact):
        assert nmse(a, b) < EXACT, nmse(a, b)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_any_team_size_decodes_as_the_float32_model(q4_1_llama, threads):
    # Two and three threads split rows and a context's positions (a short one leaves a thread no positions).
    got, exact = against_fp32(q4_1_llama, [[5, 6, 7], list(range(4, 60))], threads=threads)
    for a, b in zip(got, exact):
        assert nmse(a, b) < EXACT, nmse(a, b)


def test_a_long_prompt_in_several_calls_and_blocks_is_the_float32_models(q4_1_llama):
    # 150 positions: three calls of up to 64 tokens (each attending over the ones before), ten blocks of the cache.
    got, exact = against_fp32(q4_1_llama, [list(range(3, 153)), [7, 8, 9]], steps=10)
    for a, b in zip(got, exact):
        assert nmse(a, b) < EXACT, nmse(a, b)


def test_a_float32_cache_is_the_float32_models_too(q4_1_llama):
    got, exact = against_fp32(q4_1_llama, [list(range(3, 80)), [7, 8, 9]], kv_cache_dtype="fp32")
    for a, b in zip(got, exact):
        assert nmse(a, b) < EXACT, nmse(a, b)


def test_prompt_chunks_the_scheduler_cuts_are_the_float32_models(q4_1_llama):
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(3, 40))]
    exact = float32_reference(q4_1_llama, lambda engine: step_logits(engine, prompts, 0)[0])
    engine = engine_for(q4_1_llama, "native", max_num_batched_tokens=16)  # the longer prompt in three steps
    got = step_logits(engine, prompts, 0)[0]
    assert nmse(got, exact) < EXACT, nmse(got, exact)


X86_VARIANTS = {8: ("-mno-avx512f",), 1: ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx")}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set flags")
@pytest.mark.parametrize("lanes", X86_VARIANTS)
def test_the_avx2_and_plain_c_builds_decode_as_the_float32_model(q4_1_llama, lanes):
    library = native.build(X86_VARIANTS[lanes])
    assert library.fx_lanes() == lanes
    got, exact = against_fp32(q4_1_llama, [[5, 6, 7, 8, 9, 10, 11], [3, 5]], library=library)
    for a, b in zip(got, exact):
        assert nmse(a, b) < EXACT, nmse(a, b)


def test_a_head_its_codes_round_gets_each_rows_top_logits_in_float32(f32_head_llama):
    """A float32 head's 8-bit codes move every logit a little; each row's 16 largest come back as float32 dot
    products of the head's own rows."""
    got, exact = against_fp32(f32_head_llama, [[5, 6, 7, 8, 9, 10, 11], [3, 5]])
    for a, b in zip(got, exact):
        top = a.topk(4, dim=-1).indices
        refined = (a.gather(-1, top) - b.gather(-1, top)).abs().max().item()
        others = (a - b).abs().max().item()
        assert refined < 1e-5 and others > 10 * refined, (refined, others)


def random_int4(n, k, group, seed=0, half=True) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.1
    offsets = -8 * scales + torch.randn(n, k // group, generator=g) * 0.01
    if half:
        scales, offsets = scales.half().float(), offsets.half().float()
    return Int4Weight(pack_int4(q), scales, offsets, group)


@pytest.mark.parametrize(("group", "half"), [(32, True), (32, False), (64, True), (128, False)])
def test_the_c_layout_gives_back_the_weights_values(group, half):
    w = random_int4(8, 256, group, half=half)
    codes, scales, offsets, is_half = native.q4_layout(w)
    assert is_half == half and scales.dtype == (np.float16 if half else np.float32)
    q = np.concatenate([codes & 15, codes >> 4], axis=-1).astype(np.float32)  # [n, k/32, 32] in element order
    values = q * scales.astype(np.float32)[..., None] + offsets.astype(np.float32)[..., None]
    np.testing.assert_allclose(values.reshape(8, 256), w.dequantize().numpy(), rtol=0, atol=1e-6)


def test_a_second_build_loads_the_cached_library_without_compiling(monkeypatch):
    first = native.build()
    native.build.cache_clear()
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: pytest.fail("compiled again"))
    second = native.build()
    assert second._name == first._name and second.fx_lanes() == first.fx_lanes()


def test_without_a_compiler_auto_runs_the_graph_and_native_names_the_reason(q4_1_llama, monkeypatch):
    native.build.cache_clear()
    monkeypatch.setattr(native, "compilers", lambda: [])
    try:
        runner = engine_for(q4_1_llama, "auto").runner
        assert runner.route == "onnxruntime" and "no C compiler found" in runner.route_reason
        with pytest.raises(UserError, match="int4_route = native cannot run here: the C step did not build"):
            engine_for(q4_1_llama, "native")
    finally:
        native.build.cache_clear()


def test_a_compiler_that_fails_is_named_in_the_reason(monkeypatch, tmp_path):
    native.build.cache_clear()
    monkeypatch.setenv("FLASHNEXT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "compilers", lambda: [["false"]])
    try:
        with pytest.raises(native.BuildError, match="false: no message"):
            native.build()
    finally:
        native.build.cache_clear()


def test_auto_picks_the_c_step_where_it_builds_with_the_engines_threads(q4_1_llama):
    engine = engine_for(q4_1_llama, "auto")
    runner = engine.runner
    assert runner.route == "native" and "C step built for this CPU" in runner.route_reason
    step_logits(engine, [[5, 6, 7]], 1)
    assert runner.native.team.most == torch.get_num_threads()  # not the one thread torch has during a step


def test_a_cached_prefix_and_speculation_give_the_plain_greedy_tokens(q4_1_llama):
    """A second request on a cached prefix reads its first blocks as the first request left them; n-gram verify
    steps (several tokens of one sequence, every one's logits) run between decode steps: the tokens stay the float32
    model's."""
    from flashnext.core.engine.sequence import SamplingParams

    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    params = SamplingParams(max_tokens=16)
    want = float32_reference(q4_1_llama, lambda engine: engine.generate([prompt], params)[0].output_ids)
    cached = engine_for(q4_1_llama, "native", prefix_caching=True)
    assert [cached.generate([prompt], params)[0].output_ids for _ in range(2)] == [want, want]
    speculating = engine_for(q4_1_llama, "native", spec="ngram", spec_tokens=3)
    assert speculating.generate([prompt], params)[0].output_ids == want


def run_team(team: native.TeamSize, calls: int, seconds_at) -> list[int]:
    sizes = []
    for _ in range(calls):
        sizes.append(team.size_for(1))
        team.took(seconds_at(sizes[-1]))
    return sizes


def test_a_quiet_team_keeps_all_its_threads_and_tries_no_other_size():
    team = native.TeamSize(4)
    assert set(run_team(team, 1000, lambda n: 1.0 / n)) == {4}


def test_the_team_shrinks_when_a_neighbour_slows_it_and_grows_back_when_it_leaves():
    team = native.TeamSize(2)
    run_team(team, 50, lambda n: 1.0 / n)  # quiet: 2 threads twice as fast as one
    sizes = run_team(team, 3, lambda n: 1.5 if n == 2 else 1.0)  # a neighbour takes a core
    assert sizes == [2, 1, 1] and team.size == 1  # the slow call, then one thread tried and kept
    sizes = run_team(team, 2 * native.TeamSize.PROBE_UP_EVERY, lambda n: 1.5 if n == 2 else 1.0)
    assert team.size == 1 and sizes.count(2) == 2  # two threads tried now and then, not kept
    run_team(team, native.TeamSize.PROBE_UP_EVERY, lambda n: 1.0 / n)  # the neighbour left
    assert team.size == 2


def test_a_slow_call_that_one_thread_fewer_does_not_beat_changes_nothing():
    team = native.TeamSize(2)
    run_team(team, 50, lambda n: 1.0 / n)
    sizes = run_team(team, 1, lambda n: 0.8) + run_team(team, 100, lambda n: 1.0 / n)  # a one-off slow call
    assert sizes[:2] == [2, 1] and team.size == 2 and set(sizes[2:]) == {2}


def test_another_batch_size_starts_its_own_average():
    team = native.TeamSize(2)
    run_team(team, 50, lambda n: 1.0 / n)
    assert team.size_for(4) == 2 and team.usual is None
    team.took(5.0)  # a batch of four is slower than one, but not slow for its size
    assert team.size_for(4) == 2


def test_auto_leaves_a_build_without_vectors_to_the_graph(q4_1_llama, monkeypatch):
    monkeypatch.setattr(native, "vectorized", lambda: False)
    runner = engine_for(q4_1_llama, "auto").runner
    assert runner.route == "onnxruntime" and "no vector path for this CPU" in runner.route_reason
    assert engine_for(q4_1_llama, "native").runner.route == "native"
