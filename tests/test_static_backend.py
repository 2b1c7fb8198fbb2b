"""A backend that owns its whole forward pass with static shapes (graphs exported ahead of time, as an NPU runs
them: fixed batch 4, fixed prompt chunk, fixed context) fits the contract: its own build_model and runner, through
the real engine and scheduler."""

import numpy as np
import pytest
import torch

from flashnext.core.backend import API_VERSION, Backend, Capabilities, Probe, StaticShapes
from flashnext.core.config import ModelConfig
from flashnext.core.engine.engine import LLMEngine
from flashnext.core.engine.runner import Runner, StepInput, StepResult
from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.errors import UserError
from flashnext.core.loader import LoadedModel
from flashnext.core.profile import Profile

BATCH, CHUNK, CONTEXT, VOCAB = 4, 8, 48, 37


def static_graph(context: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The exported graph: [BATCH, CONTEXT] tokens and [BATCH] lengths in, [BATCH, VOCAB] logits out; refuses any
    other shape, as a compiled graph does. The next token depends on the whole context and its length."""
    assert context.shape == (BATCH, CONTEXT) and lengths.shape == (BATCH,)
    weights = np.arange(1, CONTEXT + 1)
    mask = weights[None, :] <= lengths[:, None]
    favourite = ((context * weights * mask).sum(axis=1) + 7 * lengths) % VOCAB
    return np.where(np.arange(VOCAB)[None, :] == favourite[:, None], 1.0, 0.0).astype(np.float32)


def reference_greedy(prompt: list[int], max_tokens: int) -> list[int]:
    """What the graph generates for one prompt alone: its context grown one token at a time."""
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_tokens and len(tokens) < CONTEXT:
        context = np.zeros((BATCH, CONTEXT), dtype=np.int64)
        context[0, : len(tokens)] = tokens
        lengths = np.array([len(tokens), 0, 0, 0])
        tokens.append(int(static_graph(context, lengths)[0].argmax()))
    return tokens[len(prompt) :]


class StaticModel:
    """What build_model gives: no DecoderModel, only what the engine reads (config, device, dtype)."""

    def __init__(self, config: ModelConfig):
        self.config, self.device, self.dtype = config, torch.device("cpu"), torch.float32


class StaticRunner(Runner):
    """Pads every step to the graph's shape. Its KV stand-in (the tokens at each cache slot) lives in the engine's
    blocks, so the scheduler's paging, preemption and prefix cache stay in charge."""

    largest_batch = 0
    largest_chunk = 0

    def __init__(self, model: StaticModel, setup):
        super().__init__(model, setup)
        self.cache = np.zeros(setup.num_blocks * setup.block_size, dtype=np.int64)
        self.steps = 0

    @staticmethod
    def kv_bytes_per_block(model, block_size: int, kv_dtype: torch.dtype) -> int:
        return block_size * 8

    def step(self, inputs: StepInput) -> StepResult:
        batch, bs = inputs.batch, self.setup.block_size
        StaticRunner.largest_batch = max(StaticRunner.largest_batch, len(batch))
        StaticRunner.largest_chunk = max(StaticRunner.largest_chunk, *(i.num_tokens for i in batch))
        assert len(batch) <= BATCH and all(i.num_tokens <= CHUNK for i in batch)
        context = np.zeros((BATCH, CONTEXT), dtype=np.int64)
        lengths = np.zeros(BATCH, dtype=np.int64)
        for row, item in enumerate(batch):
            seq, start = item.seq, item.seq.num_computed
            end = start + item.num_tokens
            assert end <= CONTEXT
            slots = [seq.block_table[p // bs] * bs + p % bs for p in range(end)]
            self.cache[slots[start:]] = seq.token_ids[start:end]  # the step's "KV write"
            context[row, :end] = self.cache[slots]  # the rest comes from the cache, prefix hits included
            lengths[row] = end
        logits = static_graph(context, lengths)
        rows = [row for row, item in enumerate(batch) for _ in range(item.num_logits)]
        self.steps += 1
        picked = torch.from_numpy(logits[rows])
        return StepResult(sampled=picked.argmax(-1), logits=picked)


class StaticBackend(Backend):
    name = "static-test"
    api_version = API_VERSION
    precisions = ("fp32",)
    capabilities = Capabilities(
        chunked_prefill=True,
        prefix_caching=True,
        unified_memory=True,
        static_shapes=StaticShapes(batch=BATCH, prefill_chunk=CHUNK, max_context=CONTEXT),
    )

    def probe(self) -> Probe:
        return Probe(True, 0.1, "a static graph in numpy")

    def profiles(self) -> dict[str, Profile]:
        return {"basic": Profile(name="basic", max_num_seqs=64, max_num_batched_tokens=512, kv_cache_max_gib=0.001)}

    def free_memory_bytes(self) -> int:
        return 1 << 30

    def build_model(self, loaded, precision, profile, quantized_head):
        return StaticModel(loaded.config)

    def runner_class(self, profile):
        return StaticRunner


class NoEos:
    eos_token_ids: list[int] = []


def loaded_model() -> LoadedModel:
    config = ModelConfig(
        architecture="llama",
        vocab_size=VOCAB,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=4096,
    )
    return LoadedModel(config, {}, NoEos(), "static graph", "static")


@pytest.fixture
def engine():
    StaticRunner.largest_batch = StaticRunner.largest_chunk = 0
    backend = StaticBackend()
    return LLMEngine(backend, loaded_model(), None, backend.profiles()["basic"])


def test_the_engine_schedules_within_the_static_shapes(engine):
    assert engine.profile.max_num_seqs == BATCH and engine.max_model_len == CONTEXT
    assert engine.profile.max_num_batched_tokens == CHUNK and engine.profile.chunked_prefill
    assert engine.backend.features["static_shapes"] and not engine.backend.features["spec_decode"]


def test_a_fifth_sequence_queues_and_every_output_is_the_graphs_own(engine):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, VOCAB, size=n).tolist() for n in (11, 3, 20, 9, 14)]  # longer ones take chunks
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    queued = False
    while engine.has_work():
        engine.step()
        queued |= len(engine.scheduler.running) == BATCH and bool(engine.scheduler.waiting)
    assert queued and StaticRunner.largest_batch == BATCH and StaticRunner.largest_chunk == CHUNK
    assert [s.output_ids for s in seqs] == [reference_greedy(p, 12) for p in prompts]
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_request_stops_at_the_fixed_context(engine):
    prompt = list(range(1, 31))
    [seq] = engine.generate([prompt], SamplingParams(max_tokens=100, ignore_eos=True))
    assert seq.finish_reason == "length" and len(seq) == CONTEXT
    assert seq.output_ids == reference_greedy(prompt, 100)
    with pytest.raises(UserError, match="context holds 48"):
        engine.add_request(list(range(1, CONTEXT + 1)), SamplingParams())


def test_a_static_backend_refuses_what_it_does_not_declare():
    backend = StaticBackend()
    for profile, word in (
        (Profile(spec="ngram"), "--spec ngram"),
        (Profile(cuda_graphs=True), "cuda_graphs"),
        (Profile(kv_cache_dtype="fp8-e4m3"), "fp8-e4m3 KV cache"),
    ):
        with pytest.raises(UserError, match=word):
            LLMEngine(backend, loaded_model(), None, profile)
