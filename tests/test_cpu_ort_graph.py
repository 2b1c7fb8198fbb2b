"""Int4 decode steps through the onnxruntime graph against the torch path: numerics, batches, threads, the switch."""

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from flashnext.core.engine.engine import LLMEngine
from flashnext.core.engine.scheduler import ScheduledSeq
from flashnext.core.engine.sequence import SamplingParams, Sequence
from flashnext.core.errors import UserError
from flashnext.core.llm import resolve_profile
from flashnext.core.loader import load_model
from flashnext.plugins.cpu import CpuBackend, int4_route_fact
from flashnext.plugins.cpu.ort_graph import RowCache
from numerics import step_logits

pytest.importorskip("onnxruntime")


def engine_for(loaded, route: str, precision: str = "int4", **overrides) -> LLMEngine:
    backend = CpuBackend()
    settings = dict(int4_route=route, kv_cache_max_gib=0.02, prefix_caching=False) | overrides
    profile = backend.profiles()["full"].overridden(**settings)
    return LLMEngine(backend, loaded, precision, profile)


def greedy(logits: list[torch.Tensor]) -> list[list[int]]:
    return [step.argmax(-1).tolist() for step in logits]


def nmse(out, ref) -> float:
    return ((out - ref) ** 2).mean().item() / (ref**2).mean().item()


# Decode logits against the torch route's: float32 activations at the reference's rounding (the 8-bit LM head's
# aside); int8 ones (blocks of the group size) at what that rounding adds, within the suite's 1e-3 int4 engine bound
# on these random models (observed: up to 7.7e-5, 3.2e-4 and 5.6e-4).
BOUNDS = {"onnxruntime": 2.5e-4, "onnxruntime-mlp-int8": 1e-3, "onnxruntime-int8": 1e-3}


def compare_routes(loaded, prompts, route="onnxruntime", steps=4, bound=None):
    """An onnxruntime route's decode logits against the torch route's, step by step on the same tokens."""
    bound = bound or BOUNDS[route]
    ref = step_logits(engine_for(loaded, "torch"), prompts, steps)
    engine = engine_for(loaded, route)
    assert engine.runner.route == route
    got = step_logits(engine, prompts, steps, forced=greedy(ref))
    assert engine.runner.graph is not None  # the steps really ran through the graph
    for a, b in zip(got, ref):  # the prompt's last logits, then each decode step's
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


@pytest.mark.parametrize(
    ("activations", "rounded"),
    [("fp32", set()), ("mlp-int8", {"gate_up", "down"}), ("int8", {"qkv", "o", "gate_up", "down"})],
)
def test_each_choice_rounds_the_activations_of_its_projections_only(q4_1_llama, activations, rounded):
    from flashnext.plugins.cpu.ort_graph import ROUNDED, GraphBuilder

    model = engine_for(q4_1_llama, "torch").model
    cfg, layer = model.config, model.layers[0]
    kinds = {w.shape[::-1]: kind for kind, w in vars(layer).items() if kind in ("qkv", "o", "gate_up", "down")}
    assert len(kinds) == 4  # (K, N) tells the projections apart
    levels = {}
    for node in GraphBuilder(model, ROUNDED[activations]).build().graph.node:
        attrs = {a.name: a.i for a in node.attribute}
        if node.op_type == "MatMulNBits" and attrs["bits"] == 4:
            levels.setdefault(kinds[(attrs["K"], attrs["N"])], set()).add(attrs["accuracy_level"])
    assert len(levels) == 4 and cfg.num_layers > 1
    assert {kind for kind, level in levels.items() if level == {4}} == rounded
    assert {kind for kind, level in levels.items() if level == {1}} == set(kinds.values()) - rounded


@pytest.mark.parametrize("route", ["onnxruntime", "native"])
def test_whatever_the_caches_held_past_a_sequences_end_does_not_leak_in(q4_1_llama, route):
    clean = step_logits(engine_for(q4_1_llama, route), [[5, 6, 7]], 3)
    engine = engine_for(q4_1_llama, route)
    engine.runner.k_cache.fill_(float("nan"))  # memory the allocator handed over holds anything
    engine.runner.v_cache.fill_(float("nan"))
    if route == "onnxruntime":  # the graph's row cache too (the C step reads the paged one)
        rows = engine.runner._graph().rows
        rows.reserve(2, 8)
        rows.k.fill_(float("nan"))
        rows.v.fill_(float("nan"))
    dirty = step_logits(engine, [[5, 6, 7]], 3, forced=greedy(clean))
    for a, b in zip(dirty, clean):
        assert torch.equal(a, b)


def paged_cache(layers=2, slots=64, kv=3, d=4):
    k = torch.randn(layers, slots, kv, d)
    return k, torch.randn_like(k)


def test_the_row_cache_copies_in_what_a_row_lacks_and_writes_the_call_back():
    paged_k, paged_v = paged_cache()
    rows = RowCache(2, 3, 4)
    rows.reserve(2, 12)
    assert rows.place_group([7, 9]) == [0, 1]
    rows.sync(0, 10, torch.tensor([3, 1, -1]), paged_k, paged_v, 8)  # blocks of 8 slots
    rows.sync(1, 4, torch.tensor([0, 2, -1]), paged_k, paged_v, 8)
    slots = [24 + p for p in range(8)] + [8, 9]  # sequence 7: block 3, then block 1
    assert torch.equal(rows.k[:, 0, :, :10], paged_k[:, slots].transpose(1, 2))
    assert torch.equal(rows.v[:, 1, :, :4], paged_v[:, :4].transpose(1, 2))
    rows.k[:, 0, :, 10] = 1.5  # what the call's attention wrote in place at position 10
    rows.v[:, 1, :, 4:7] = 2.5  # and three positions of a longer piece
    rows.write_back(0, 10, [10], paged_k, paged_v)
    rows.write_back(1, 4, [4, 5, 16], paged_k, paged_v)
    assert (paged_k[:, 10] == 1.5).all() and (paged_v[:, [4, 5, 16]] == 2.5).all()
    assert rows.length[:2] == [11, 7]


def test_the_row_cache_copies_only_new_positions_and_everything_for_another_sequence():
    paged_k, paged_v = paged_cache()
    table = torch.tensor([0, 1])
    rows = RowCache(2, 3, 4)
    rows.reserve(1, 16)
    rows.place_group([7])
    rows.sync(0, 5, table, paged_k, paged_v, 8)
    rows.k[:, 0, :, :5] = 0.0  # a copy of position < 5 from here on would show
    paged_k[:, 5:9] = 4.0  # positions computed since through another row or the torch path
    rows.sync(0, 9, table, paged_k, paged_v, 8)
    assert (rows.k[:, 0, :, :5] == 0).all() and (rows.k[:, 0, :, 5:9] == 4).all()
    rows.sync(0, 3, table, paged_k, paged_v, 8)  # a rejected draft's positions past 3 are dropped, not copied
    assert rows.length[0] == 3 and (rows.k[:, 0, :, :3] == 0).all()
    rows.place_group([8])  # another sequence in that row: all of it again
    rows.sync(0, 9, table, paged_k, paged_v, 8)
    assert torch.equal(rows.k[:, 0, :, :9], paged_k[:, :9].transpose(1, 2))


def test_a_batch_keeps_its_rows_when_a_sequence_leaves_and_pieces_go_past_it():
    rows = RowCache(1, 1, 2)
    assert rows.place_group([1, 2, 3]) == [0, 1, 2]
    rows.length[:3] = [5, 6, 7]
    rows.release({1, 3, 4})  # 2 finished
    assert rows.place_group([1, 3]) == [0, 1]  # 3 moves into 2's row: only it copies again
    assert rows.length[:2] == [5, 0]
    assert rows.place_one(4, busy=2) == 2  # a prompt chunk takes a row past the batch's
    assert rows.place_one(4, busy=2) == 2  # and keeps it for its next chunk
    assert rows.place_group([1, 3, 4]) == [0, 1, 2]  # it joins the batch where it is
    assert rows.place_one(5, busy=3) == 3  # no free row past the batch: one more


def test_the_row_cache_grows_by_doubling_and_keeps_what_it_held():
    rows = RowCache(1, 1, 2)
    rows.reserve(1, 3)
    rows.k[0, 0, 0, :3] = torch.arange(6.0).view(3, 2)
    version = rows.version
    rows.reserve(1, RowCache.FIRST_CAPACITY)
    assert rows.version == version  # nothing moved
    rows.reserve(3, RowCache.FIRST_CAPACITY + 1)
    assert rows.version == version + 1
    assert rows.k.shape == (1, 3, 1, 2 * RowCache.FIRST_CAPACITY, 2)
    assert torch.equal(rows.k[0, 0, 0, :3], torch.arange(6.0).view(3, 2))
    assert rows.owner == [None, None, None] and rows.length == [0, 0, 0]


def test_batches_that_change_between_steps_decode_like_the_torch_route(q4_1_llama):
    """Rows are reassigned when sequences leave, join or change places, and a sequence grows past the row cache's
    first capacity: each step's logits stay the torch route's."""
    prompts = [list(range(5, 5 + n)) for n in (3, 9, RowCache.FIRST_CAPACITY - 2)]
    schedule = [[0, 1, 2], [2, 0], [1, 2, 0], [1], [0, 1, 2], [2], [2]]

    def run(route):
        engine = engine_for(q4_1_llama, route, kv_cache_max_gib=0.05)
        seqs = [Sequence(list(p), SamplingParams()) for p in prompts]
        for seq in seqs:
            engine.blocks.grow(seq, len(seq.token_ids) + len(schedule))
            engine.runner.run([ScheduledSeq(seq, len(seq.token_ids), 1)])
            seq.num_computed = len(seq.token_ids)
        out = []
        for step, rows in enumerate(schedule):
            for i in rows:
                seqs[i].token_ids.append(100 + 7 * step + i)
                seqs[i].num_computed = len(seqs[i].token_ids) - 1
            out.append(engine.runner.run([ScheduledSeq(seqs[i], 1, 1) for i in rows])[0])
        return out, engine

    want, _ = run("torch")
    got, engine = run("onnxruntime")
    assert engine.runner.graph is not None
    assert engine.runner.graph.rows.k.shape[3] == 2 * RowCache.FIRST_CAPACITY  # it grew
    for a, b in zip(got, want):
        assert nmse(a, b) < BOUNDS["onnxruntime"]


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
        options = engine.runner.graph.session.get_session_options()
        assert options.intra_op_num_threads == 1
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
        assert options.get_session_config_entry("session.intra_op.spin_duration_us") == "20"  # bounded
    finally:
        torch.set_num_threads(before)


def test_a_graph_step_leaves_torch_one_thread_and_gives_the_count_back(q4_1_llama):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        engine = engine_for(q4_1_llama, "onnxruntime")
        graph = engine.runner._graph()
        seen, step = [], graph.step
        graph.step = lambda *args: seen.append(torch.get_num_threads()) or step(*args)
        step_logits(engine, [[5, 6, 7]], 1)
        assert seen == [1, 1] and torch.get_num_threads() == 2  # the prompt's step, then one decode step
        assert graph.session.get_session_options().intra_op_num_threads == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_default_model_generates_the_torch_routes_greedy_tokens():
    """float32 activations keep the torch route's tokens; int8 ones (llama.cpp's rounding) are only checked near."""
    loaded = load_model(None)
    prompts = [loaded.tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):", "Once upon a")]
    compare_routes(loaded, prompts[:1], "onnxruntime", steps=4, bound=1e-3)  # the 8-bit head: 3.3e-4 observed
    compare_routes(loaded, prompts[:1], "onnxruntime-mlp-int8", steps=4, bound=0.02)
    compare_routes(loaded, prompts[:1], "onnxruntime-int8", steps=4, bound=0.05)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.output_ids for o in engine_for(loaded, "torch").generate(prompts, params)]
    assert [o.output_ids for o in engine_for(loaded, "onnxruntime").generate(prompts, params)] == want


@pytest.mark.slow
def test_auto_route_keeps_the_readme_answer():
    """`auto` keeps float32 activations because the README's question must get the reference's answer: rounding
    the down projection's input to int8 (onnxruntime-mlp-int8) turns its first token."""
    loaded = load_model(None)
    chat = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompt = loaded.tokenizer.encode(chat, add_special_tokens=False)
    params = SamplingParams(max_tokens=12)
    answers = {r: engine_for(loaded, r).generate([prompt], params)[0].output_ids for r in ("torch", "auto")}
    assert answers["auto"] == answers["torch"]
    assert loaded.tokenizer.decode(answers["auto"]).startswith("The capital of France is Paris")


def test_auto_picks_a_graph_route_for_int4_and_torch_for_other_precisions(q4_1_llama):
    runner = engine_for(q4_1_llama, "auto").runner
    assert runner.route in ("native", "onnxruntime") and "float32 activations" in runner.route_reason
    assert "float32 activations" in engine_for(q4_1_llama, "onnxruntime").runner.route_reason
    assert "int8 activations into the MLP" in engine_for(q4_1_llama, "onnxruntime-mlp-int8").runner.route_reason
    assert "onnxruntime" in int4_route_fact()
    fp32 = engine_for(q4_1_llama, "auto", precision="fp32").runner
    assert fp32.route == "torch" and "not int4" in fp32.route_reason
    assert engine_for(q4_1_llama, "torch").runner.route == "torch"


def test_batch_invariance_keeps_decode_on_the_torch_route(q4_1_llama):
    """onnxruntime's GEMM blocking follows the row count, so a batch-invariant engine decodes through torch, and an
    explicit onnxruntime route is refused with the reason."""
    runner = engine_for(q4_1_llama, "auto", batch_invariant=True).runner
    assert runner.route == "torch" and "batch_invariant" in runner.route_reason
    with pytest.raises(UserError, match="int4_route = onnxruntime cannot run this model: batch_invariant"):
        engine_for(q4_1_llama, "onnxruntime", batch_invariant=True)


def test_asking_for_onnxruntime_where_it_cannot_run_names_the_reason(q4_1_llama, monkeypatch):
    from flashnext.plugins.cpu import ort_graph

    monkeypatch.setattr(ort_graph, "BLOCK_SIZES", (64, 128))  # the model's groups of 32 then do not fit the graph
    with pytest.raises(UserError, match="int4_route = onnxruntime cannot run this model: int4 group size 32 is not"):
        engine_for(q4_1_llama, "onnxruntime")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_route_asked_for_leaves_steps_of_other_precisions_to_torch(q4_1_llama, precision):
    runner = engine_for(q4_1_llama, "onnxruntime-mlp-int8", precision=precision).runner
    assert runner.route == "torch" and "not int4" in runner.route_reason


def test_the_route_is_an_env_setting(monkeypatch):
    monkeypatch.setenv("FLASHNEXT_INT4_ROUTE", "torch")
    assert resolve_profile(CpuBackend(), None, {}).int4_route == "torch"
    monkeypatch.setenv("FLASHNEXT_INT4_ROUTE", "fast")
    with pytest.raises(UserError, match="int4_route"):
        resolve_profile(CpuBackend(), None, {})


def test_a_head_the_graph_cannot_read_keeps_the_torch_route(q4_1_llama):
    from flashnext.plugins.cpu.ort_graph import unsupported

    model = engine_for(q4_1_llama, "torch").model
    assert unsupported(model, torch.float32) is None
    model.lm_head = model.layers[0].qkv  # an Int4Weight (not the embedding's shape), as an int4 head would be
    assert "LM head is stored as Int4Weight" in unsupported(model, torch.float32)


def test_the_fp16_head_copy_is_made_only_for_the_torch_route(q4_1_llama):
    """The graph reads its own 8-bit codes of the head, so the model keeps the head in float32 (a tied one is the
    embedding itself); torch's int4 steps read an fp16 copy (half the bytes a step)."""
    graph_model = engine_for(q4_1_llama, "onnxruntime").model
    assert graph_model.lm_head.dtype == torch.float32
    torch_model = engine_for(q4_1_llama, "torch").model
    assert torch_model.lm_head.dtype == torch.float16
    assert torch.equal(torch_model.lm_head, graph_model.lm_head.half())


def test_each_rows_largest_logits_are_the_float32_heads(q4_1_llama):
    """The 8-bit head moves every logit a little; a row's REFINE_TOP largest (as the 8-bit head ranks them) come back
    as float32 products of the head's own rows: the exact model's, but for the summation order. (The last of them
    may trade places with an unrefined one, so the check takes the first few.)"""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 5]]
    exact = step_logits(engine_for(q4_1_llama, "torch", precision="fp32"), prompts, 2)
    got = step_logits(engine_for(q4_1_llama, "onnxruntime"), prompts, 2, forced=greedy(exact))
    for a, b in zip(got, exact):
        top = a.topk(4, dim=-1).indices
        refined = (a.gather(-1, top) - b.gather(-1, top)).abs().max().item()
        others = (a - b).abs().max().item()
        assert refined < 1e-4 and others > 10 * refined, (refined, others)


def test_the_head_codes_built_in_row_chunks_equal_the_whole_tables(q4_1_llama, monkeypatch):
    from flashnext.plugins.cpu import head as int8_head
    from flashnext.plugins.cpu import ort_graph

    model = engine_for(q4_1_llama, "onnxruntime").model
    head = int8_head.head_weight(model)
    whole = int8_head.block_codes(head.reshape(head.shape[0], -1, int8_head.HEAD_BLOCK))
    monkeypatch.setattr(int8_head, "HEAD_ROWS_AT_ONCE", 7)  # the tiny vocabulary in many chunks, the last short
    monkeypatch.setattr(ort_graph, "EXTERNAL_BYTES", 0)  # every constant handed over as an array, to read back
    builder = ort_graph.GraphBuilder(model)
    builder.build()
    codes = next(a for name, a in builder.external.items() if name.startswith("head_codes"))
    scales = next(a for name, a in builder.external.items() if name.startswith("head_scales"))
    assert head.shape[0] % 7 and torch.equal(torch.from_numpy(codes), whole[0])
    assert torch.equal(torch.from_numpy(scales), whole[1])


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def q8_head_llama(request, tmp_path_factory):
    """llama.cpp's Q4_1 layout: int4 layers, the embedding and output tables in Q8_0."""
    from fixtures import write_tiny_gguf

    folder = tmp_path_factory.mktemp("q8head")
    path, _ = write_tiny_gguf(folder / "tiny.gguf", tie=request.param, qtype="Q4_1", head_qtype="Q8_0")
    return load_model(str(path))


def test_a_q8_0_head_is_read_from_the_graphs_codes_and_its_float_table_freed(q8_head_llama):
    """Codes that give the head back exactly replace its float32 rows in the graph's refine and, for a tied table,
    in the embedding: the model's float tables are freed (an untied embedding stays, the steps read it), and the
    logits stay the torch route's where refined."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 5]]
    exact = step_logits(engine_for(q8_head_llama, "torch", precision="fp32"), prompts, 2)
    engine = engine_for(q8_head_llama, "onnxruntime")
    got = step_logits(engine, prompts, 2, forced=greedy(exact))
    model, tied = engine.runner.model, q8_head_llama.config.tie_word_embeddings
    assert engine.runner.graph.own_head and model.lm_head is None
    assert (model.embed is None) == tied
    for a, b in zip(got, exact):
        top = a.topk(4, dim=-1).indices
        assert (a.gather(-1, top) - b.gather(-1, top)).abs().max().item() < 1e-4


def test_the_embedding_rows_from_the_head_codes_are_the_tables(q8_head_llama):
    engine = engine_for(q8_head_llama, "onnxruntime")
    table = engine.model.embed
    graph = engine.runner._graph()
    ids = torch.arange(table.shape[0])
    assert graph.own_head and torch.equal(graph.embed(ids), table)


def test_a_head_its_codes_round_keeps_the_float_tables(q4_1_llama):
    """A Q4_1 table's values are not 8-bit codes: the graph refines from the float rows, which stay."""
    engine = engine_for(q4_1_llama, "onnxruntime")
    graph = engine.runner._graph()
    assert not graph.own_head and graph.head_rows is not None
    assert engine.model.lm_head is not None and engine.model.embed is not None


def test_a_runner_with_an_mtp_drafter_keeps_the_tables_its_torch_steps_read(q8_head_llama):
    engine = engine_for(q8_head_llama, "onnxruntime")
    runner = engine.runner
    runner.setup = dataclasses.replace(runner.setup, mtp=object())  # the drafter's steps ask for hidden states
    assert runner._graph().own_head and runner.graph.constants.apart_from_model
    assert runner.model.lm_head is not None and runner.model.embed is not None
    assert len(runner.model.layers) == q8_head_llama.config.num_layers


def rss_file_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_constants_in_a_file_read_back_and_leave_memory_once_dropped(tmp_path):
    from flashnext.plugins.cpu.ort_graph import Constants

    big, small = np.arange(16 << 20, dtype=np.float32), np.arange(10, dtype=np.int64)  # 64 MiB, 80 bytes
    constants = Constants({"big": big, "small": small}, tmp_path / "scratch")
    assert constants.apart_from_model and not constants.arrays["big"].flags.writeable
    assert np.array_equal(constants.arrays["big"], big) and np.array_equal(constants.arrays["small"], small)
    resident = rss_file_mib()
    constants.drop_resident()
    assert rss_file_mib() < resident - 48
    assert np.array_equal(constants.arrays["big"], big)  # read back from the file
    assert list((tmp_path / "scratch").iterdir()) == []  # unlinked: nothing is left behind


def test_constants_stay_in_memory_without_a_folder_that_takes_them(tmp_path):
    from flashnext.plugins.cpu.ort_graph import Constants

    arrays = {"a": np.ones(4, np.float32)}
    assert not Constants(arrays, None).apart_from_model
    (tmp_path / "taken").write_text("")  # a file where the folder would be
    constants = Constants(arrays, tmp_path / "taken" / "scratch")
    assert not constants.apart_from_model and constants.arrays["a"] is arrays["a"]
    assert Constants({}, None).apart_from_model  # nothing of the model's handed over


def test_a_graph_with_its_constants_in_a_file_frees_the_models_projections(q4_1_llama, monkeypatch):
    from flashnext.plugins.cpu import ort_graph

    monkeypatch.setattr(ort_graph, "EXTERNAL_BYTES", 256)  # the weights handed over by address, as a real model's
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 5]]
    ref = step_logits(engine_for(q4_1_llama, "torch"), prompts, 3)
    engine = engine_for(q4_1_llama, "onnxruntime")
    got = step_logits(engine, prompts, 3, forced=greedy(ref))
    assert engine.runner.graph.constants.apart_from_model and engine.model.layers == []
    for a, b in zip(got, ref):
        assert 0 < nmse(a, b) < BOUNDS["onnxruntime"]


def test_constants_left_in_memory_keep_the_models_projections(q4_1_llama, monkeypatch):
    """With the cache off they are views of the model's own tensors, which onnxruntime reads: those stay."""
    from flashnext.plugins.cpu import ort_graph

    monkeypatch.setattr(ort_graph, "EXTERNAL_BYTES", 256)
    monkeypatch.setenv("FLASHNEXT_CACHE_DIR", "off")
    engine = engine_for(q4_1_llama, "onnxruntime")
    assert not engine.runner._graph().constants.apart_from_model
    assert len(engine.model.layers) == q4_1_llama.config.num_layers


@pytest.mark.parametrize("spin_us, allowed, duration", [(0, "0", "0"), (20, "1", "20"), (None, "1", None)])
def test_the_pools_spin_setting_reaches_the_session(q4_1_llama, spin_us, allowed, duration):
    from flashnext.plugins.cpu.ort_graph import OrtModel

    options = OrtModel(engine_for(q4_1_llama, "onnxruntime").model, 2, "fp32", spin_us).session.get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == allowed
    if duration is None:  # onnxruntime's own spinning, unbounded
        with pytest.raises(RuntimeError, match="does not have configuration"):
            options.get_session_config_entry("session.intra_op.spin_duration_us")
    else:
        assert options.get_session_config_entry("session.intra_op.spin_duration_us") == duration


RETAINED_HEAP = """
import numpy as np
from flashnext.plugins.cpu.runner import release_freed_heap

def rss_mib():
    status = open("/proc/self/status").read().splitlines()
    return int(next(li for li in status if li.startswith("VmRSS:")).split()[1]) / 1024

blocks = [np.ones(1 << 20, np.uint8) for _ in range(200)]  # 200 MiB on the heap (the env keeps them off mmap)
keep = np.ones(1 << 10, np.uint8)  # above them, so freeing them leaves a hole glibc keeps
del blocks
before = rss_mib()
print(release_freed_heap(), before - rss_mib())
"""


def test_the_heap_the_graph_build_freed_goes_back_to_the_system():
    """glibc keeps large freed blocks for reuse; release_freed_heap (run after the graph build) returns them."""
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
    done = subprocess.run([sys.executable, "-c", RETAINED_HEAP], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    released, freed_mib = done.stdout.split()
    if released == "False":
        pytest.skip("the C library is not glibc: no malloc_trim")
    assert freed_mib and float(freed_mib) > 150


def test_building_the_graph_releases_the_freed_heap(q4_1_llama, monkeypatch):
    from flashnext.plugins.cpu import runner

    calls = []
    monkeypatch.setattr(runner, "release_freed_heap", lambda: calls.append(True))
    engine = engine_for(q4_1_llama, "onnxruntime")
    step_logits(engine, [[5, 6, 7]], 1)
    assert calls == [True]  # once, when the graph was built: not every step
