"""Engine equivalences on tiny random models (fp32, CPU backend).

Chunked prefill, prefix-cache hits and batching change how a prompt's tokens are grouped into steps, never the
numbers: every position's logits match an unchunked prefill, and greedy outputs are identical.
"""

import random

import pytest
import torch

from fixtures import write_tiny_hf_model
from flashnext.core.engine.engine import GIB, LLMEngine
from flashnext.core.engine.runner import ModelRunner
from flashnext.core.engine.scheduler import ScheduledSeq
from flashnext.core.engine.sequence import SamplingParams, Sequence
from flashnext.core.llm import LLM
from flashnext.core.loader import load_model
from flashnext.plugins.cpu import CpuBackend

BS = 4
CHUNKS = (1, 7, 16, 64)
PROMPT_LENS = (5, 37, 100, 150)  # ragged against every chunk size: 150 = 2*64 + 22 = 21*7 + 3 = 9*16 + 6


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: thread hand-offs cost more than the math, ten times more on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    return load_model(write_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=request.param))


def kv_gib(loaded, num_blocks: int) -> float:
    """A KV budget of exactly `num_blocks` fp32 blocks."""
    cfg = loaded.config
    block_bytes = 2 * cfg.num_layers * BS * cfg.num_kv_heads * cfg.head_dim * 4
    return (num_blocks + 0.5) * block_bytes / GIB


def engine_for(loaded, **overrides) -> LLMEngine:
    backend = CpuBackend()
    settings = dict(block_size=BS, max_num_batched_tokens=64, kv_cache_max_gib=kv_gib(loaded, 4096))
    profile = backend.profiles()["full"].overridden(**(settings | overrides))
    return LLMEngine(backend, loaded, "fp32", profile)


def prompts(loaded, lens=PROMPT_LENS, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = loaded.config.vocab_size
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def prefill_logits(engine: LLMEngine, prompt: list[int], chunk: int) -> tuple[int, torch.Tensor]:
    """Logits of every computed prompt position, prefilled in `chunk`-token steps through the engine's own
    block manager, runner and model. Returns (first computed position, logits [positions, vocab])."""
    seq = Sequence(list(prompt), SamplingParams())
    assert engine.blocks.admit(seq)
    start, rows = seq.num_computed, []
    while seq.num_computed < len(seq):
        n = min(chunk, len(seq) - seq.num_computed)
        engine.blocks.grow(seq, seq.num_computed + n)
        inputs = engine.runner.prepare([ScheduledSeq(seq, n, n)])
        rows.append(engine.model.compute_logits(engine.runner.forward(inputs)))
        seq.num_computed += n
        engine.blocks.commit_full_blocks(seq)
    engine.blocks.free_sequence(seq)
    return start, torch.cat(rows)


def assert_same_logits(got: torch.Tensor, want: torch.Tensor):
    assert got.shape == want.shape
    nmse = ((got - want).pow(2).mean() / want.pow(2).mean()).item()
    assert nmse <= 1e-10, nmse
    # fp32 GEMMs sum in an order that follows the row count (chunks are shorter): 1e-5 of the largest logit.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))


def greedy(engine: LLMEngine, batch: list[list[int]], max_tokens=12, **params) -> list[list[int]]:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    seqs = [engine.add_request(p, sampling) for p in batch]
    while engine.has_work():
        engine.step()
    assert all(s.finish_reason == "length" for s in seqs)
    return [s.output_ids for s in seqs]


def test_chunked_prefill_logits_match_unchunked_at_every_position(tiny):
    engine = engine_for(tiny, prefix_caching=False)
    for prompt in prompts(tiny):
        start, whole = prefill_logits(engine, prompt, len(prompt))
        assert start == 0 and whole.shape[0] == len(prompt)
        for chunk in CHUNKS:
            assert_same_logits(prefill_logits(engine, prompt, chunk)[1], whole)


def test_chunked_prefill_greedy_outputs_match_unchunked(tiny):
    batch = prompts(tiny)
    want = greedy(engine_for(tiny, chunked_prefill=False, prefix_caching=False), batch)
    for chunk in CHUNKS:
        engine = engine_for(tiny, prefix_caching=False)
        engine.scheduler.max_num_batched_tokens = chunk  # below the profile's floor of 16: the scheduler allows it
        assert greedy(engine, batch) == want, f"chunk {chunk}"
        assert engine.scheduler.prefill_chunks > 0


def test_scheduler_feeds_budget_sized_chunks_with_a_ragged_last_one(tiny):
    engine = engine_for(tiny, max_num_batched_tokens=16)
    schedule, sizes = engine.scheduler.schedule, []

    def recording_schedule():
        batch = schedule()
        sizes.append([item.num_tokens for item in batch])
        return batch

    engine.scheduler.schedule = recording_schedule
    greedy(engine, prompts(tiny, lens=[150]), max_tokens=2)
    assert sizes == [[16]] * 9 + [[6], [1]]
    assert engine.scheduler.prefill_chunks == 10


def test_prefix_cache_hit_logits_match_a_miss(tiny):
    shared = prompts(tiny, lens=[41], seed=1)[0]
    tails = prompts(tiny, lens=[3, 30, 64], seed=2)
    cold = engine_for(tiny, prefix_caching=False)
    for tail in tails:
        prompt = shared + tail
        _, miss = prefill_logits(cold, prompt, len(prompt))
        for chunk in (7, len(prompt)):
            engine = engine_for(tiny)
            prefill_logits(engine, shared, len(shared))  # publishes 10 full blocks
            start, hit = prefill_logits(engine, prompt, chunk)
            assert start == 40  # 10 cached blocks of 4 tokens
            assert_same_logits(hit, miss[start:])


def test_prefix_cache_hit_greedy_outputs_match_a_miss(tiny):
    shared = prompts(tiny, lens=[45], seed=3)[0]
    batch = [shared + tail for tail in prompts(tiny, lens=[1, 9, 20], seed=4)] + [shared]
    want = greedy(engine_for(tiny, prefix_caching=False), batch)
    engine = engine_for(tiny)
    greedy(engine, [shared], max_tokens=1)
    hits = engine.blocks.prefix_hits
    got = [greedy(engine, [p])[0] for p in batch]
    assert got == want
    assert engine.blocks.prefix_hits - hits >= 4 * 11  # every request reused the 11 shared full blocks


def test_greedy_output_does_not_depend_on_the_batch(tiny):
    target = prompts(tiny, lens=[33], seed=5)[0]
    others = prompts(tiny, lens=[2, 17, 90, 64, 5, 120], seed=6)
    solo = greedy(engine_for(tiny, prefix_caching=False), [target], max_tokens=20)[0]
    for budget, mix in ((16, others[:2]), (64, others), (512, others[2:])):
        engine = engine_for(tiny, max_num_batched_tokens=max(budget, 16), prefix_caching=False)
        outputs = greedy(engine, others[: len(mix) // 2] + [target] + mix[len(mix) // 2 :], max_tokens=20)
        assert outputs[len(mix) // 2] == solo, f"budget {budget}"


def test_seeded_sampling_does_not_depend_on_the_batch(tiny):
    target = prompts(tiny, lens=[21], seed=7)[0]
    params = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    solo = greedy(engine_for(tiny), [target], max_tokens=16, **params)[0]
    batched = greedy(
        engine_for(tiny, max_num_batched_tokens=16), prompts(tiny, seed=8) + [target], max_tokens=16, **params
    )[-1]
    assert batched == solo


def test_preemption_under_a_tiny_cache_completes_every_request_unchanged(tiny):
    batch = prompts(tiny, lens=[30, 45, 60, 25, 50, 40, 55, 35], seed=9)
    solo = [greedy(engine_for(tiny), [p], max_tokens=40)[0] for p in batch]
    # 40 blocks of 4 tokens: any one request (<= 100 tokens) fits, all eight together (~660) do not.
    engine = engine_for(tiny, kv_cache_max_gib=kv_gib(tiny, 40), max_num_batched_tokens=32)
    assert engine.blocks.num_blocks == 40
    got = greedy(engine, batch, max_tokens=40)
    assert engine.scheduler.preemptions > 0
    assert got == solo
    assert engine.blocks.num_free == 40 and set(engine.blocks.ref_counts) == {0}
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_lookahead_slots_come_from_free_blocks_and_change_nothing(tiny, monkeypatch):
    """A runner that runs steps ahead (CUDA) gets lookahead_tokens KV slots past each decoding sequence, from free
    blocks only: with room they are there after every step; in a cache too small for them, requests still finish
    with the same tokens and every block comes back."""
    batch = prompts(tiny, lens=[30, 45, 60, 25, 50, 40, 55, 35], seed=9)
    plain = greedy(engine_for(tiny), batch, max_tokens=20)
    monkeypatch.setattr(ModelRunner, "lookahead_tokens", 12)
    roomy = engine_for(tiny)
    seqs = [roomy.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in batch[:2]]
    while roomy.has_work():
        roomy.step()
        decoding = [s for s in seqs if not s.finish_reason and s.num_uncomputed == 1]
        assert all(len(s.block_table) * BS >= len(s) + 12 for s in decoding)
    assert [s.output_ids for s in seqs] == plain[:2]
    tight = engine_for(tiny, kv_cache_max_gib=kv_gib(tiny, 40), max_num_batched_tokens=32)
    assert greedy(tight, batch, max_tokens=20) == plain
    assert tight.blocks.num_free == 40


def test_a_request_longer_than_the_whole_cache_stops_instead_of_hanging(tiny):
    engine = engine_for(tiny)
    engine.blocks.num_blocks = 10  # only the first 10 blocks may be used: 40 tokens
    engine.blocks.free = type(engine.blocks.free).fromkeys(range(10))
    seq = engine.add_request(prompts(tiny, lens=[30])[0], SamplingParams(max_tokens=100, ignore_eos=True))
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < 200
    assert seq.finish_reason == "length" and len(seq) == 41
    assert engine.blocks.num_free == 10


def test_abort_frees_blocks_at_once(tiny):
    engine = engine_for(tiny, max_num_batched_tokens=16)
    running = engine.add_request(prompts(tiny, lens=[40])[0], SamplingParams(max_tokens=50))
    waiting = engine.add_request(prompts(tiny, lens=[40], seed=1)[0], SamplingParams(max_tokens=50))
    engine.step()
    assert running.block_table and not waiting.block_table
    engine.abort(running)
    engine.abort(waiting)
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert running.finish_reason == waiting.finish_reason == "abort" and not engine.has_work()


def test_llm_stream_yields_what_generate_returns_and_closing_it_frees_blocks(tiny):
    llm = LLM(model=tiny, backend="cpu", profile="full", block_size=BS, kv_cache_max_gib=kv_gib(tiny, 512))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for prompt in prompts(tiny, lens=[20, 3], seed=10):
        want = llm.generate([prompt], params)[0]
        pieces = list(llm.stream(prompt, params))
        assert [t for _, ids in pieces for t in ids] == want.token_ids
        assert "".join(text for text, _ in pieces) == want.text
    stream = llm.stream(prompts(tiny, lens=[30], seed=11)[0], params)
    next(stream)
    stream.close()  # a client that goes away mid-stream
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks and not llm.engine.has_work()


def test_kv_budget_leaves_room_for_the_warm_up_peak(tiny_llama):
    """Where a backend can measure memory, a warm-up prefill runs first and its peak comes off the KV budget."""
    from flashnext.core.engine.engine import GIB, LLMEngine
    from flashnext.core.loader import load_model
    from flashnext.plugins.cpu import CpuBackend

    class Measuring(CpuBackend):
        runs = 0

        def free_memory_bytes(self):
            return 2 * GIB

        def peak_memory_bytes(self, run):
            Measuring.runs += 1
            run()
            return 3 * GIB // 2  # pretend the prefill needed three quarters of what is free

    loaded = load_model(str(tiny_llama))
    profile = (
        CpuBackend().profiles()["full"].overridden(memory_utilization=1.0, kv_cache_max_gib=None, max_num_seqs=4096)
    )
    plain = LLMEngine(CpuBackend(), loaded, "fp32", profile.overridden(kv_cache_max_gib=2.0))
    measured = LLMEngine(Measuring(), loaded, "fp32", profile)
    assert Measuring.runs == 1
    block_bytes = plain.runner.kv_bytes_per_block(plain.model, profile.block_size, plain.kv_dtype)
    assert measured.blocks.num_blocks == (GIB // 2) // block_bytes
    assert plain.blocks.num_blocks > measured.blocks.num_blocks


def _weights_bytes(model) -> int:
    tensors = [model.embed, model.norm] + ([] if model.lm_head is model.embed else [model.lm_head])
    for layer in model.layers:
        tensors += [getattr(layer, f) for f in ("input_norm", "q_norm", "k_norm", "post_norm", "qkv_bias")]
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
            tensors += [w] if isinstance(w, torch.Tensor) else list(vars(w).values())
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("precision", ["bf16", "fp8-e4m3", "int4"])
def test_weight_bytes_is_what_the_model_keeps(precision):
    """The up-front memory check's count: at least what the built model holds, and close to it."""
    from flashnext.core.cli_bench import random_model_of
    from flashnext.core.config import ModelConfig
    from flashnext.core.kernels import ReferenceKernels
    from flashnext.core.model import DecoderModel, weight_bytes
    from flashnext.core.precision import PRECISIONS

    cfg = ModelConfig(
        architecture="qwen3",
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        qk_norm=True,
    )
    loaded = random_model_of(cfg, "mid", torch.device("cpu"))
    p = PRECISIONS[precision]
    model = DecoderModel(cfg, loaded.weights, ReferenceKernels(), p, torch.device("cpu"), torch.bfloat16)
    estimate, kept = weight_bytes(cfg, loaded.weights, p, torch.bfloat16), _weights_bytes(model)
    assert estimate <= kept <= estimate * 1.01


def test_weights_past_an_accelerators_free_memory_are_refused_with_the_precisions_that_fit(tiny_llama):
    """Before anything moves: one line naming the model, its size in the asked precision, what is free, and the
    smaller precisions that would fit (or a smaller model when none does), exit code 2."""
    from flashnext.core.errors import UserError
    from flashnext.core.model import prefill_token_bytes, weight_bytes
    from flashnext.core.precision import PRECISIONS

    loaded = load_model(str(tiny_llama))
    config, profile = loaded.config, CpuBackend().profiles()["basic"]
    tokens = min(profile.max_num_batched_tokens, config.max_position_embeddings)
    per_token = prefill_token_bytes(config, torch.bfloat16, 2)
    assert per_token > 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2  # KV and activations
    chunk = tokens * per_token + config.vocab_size * 4

    def need(name):
        return weight_bytes(loaded.config, loaded.weights, PRECISIONS[name], torch.bfloat16) + chunk

    class Accelerator(CpuBackend):
        capabilities = CpuBackend.capabilities.model_copy(update={"unified_memory": False})
        free = 0

        def device(self):
            return torch.device("meta")  # never reached: the check comes first

        def activation_dtype(self, precision):
            return torch.bfloat16

        def free_memory_bytes(self):
            return self.free

    backend = Accelerator()
    backend.free = need("bf16") - 1
    with pytest.raises(UserError) as err:
        LLMEngine(backend, loaded, "bf16", profile)
    message = str(err.value)
    assert message.startswith(f"{loaded.source}: its weights and a {tokens}-token prefill need at least")
    assert "as bf16" in message and "\n" not in message
    assert message.endswith(
        f"use --precision fp8-e4m3 (0.0 GiB) or --precision int4 (0.0 GiB) or --max-num-batched-tokens {tokens - 1}"
    )
    assert err.value.exit_code == 2
    backend.free = need("bf16") - chunk + config.vocab_size * 4 + 100 * per_token  # room for a 100-token chunk
    with pytest.raises(UserError, match=r"GiB free; use --max-num-batched-tokens 100$"):
        LLMEngine(backend, loaded, "bf16", profile)
    backend.free = need("int4") - chunk + 15 * per_token  # not even the smallest chunk
    with pytest.raises(UserError, match="GiB free; pick a smaller model$"):
        LLMEngine(backend, loaded, "int4", profile)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_stops_at_agrees_with_the_stop_list_the_device_runner_takes(ignore_eos):
    """The engine's per-token check and the list a look-ahead runner stops at are one rule."""
    params = SamplingParams(ignore_eos=ignore_eos, stop_token_ids=[9, 3, 9])
    eos = frozenset({3, 1})
    for token in range(12):
        assert params.stops_at(token, eos) == (token in params.stop_ids(eos))
    assert params.stops_at(9, eos) != ignore_eos and params.stops_at(1, eos) != ignore_eos
    assert not params.stops_at(4, eos)


@pytest.mark.parametrize(
    "field, value", [("top_k", 2**63), ("top_k", 10**30), ("max_tokens", 2**40), ("seed", 2**64), ("seed", -(2**64))]
)
def test_sampling_params_refuse_values_past_the_samplers_int64(field, value):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{field: value})
