"""CUDA graph runner: decode steps replay captured graphs, several steps per host round trip.

The host here is the bottleneck (tens of microseconds per Python-level torch call), so a decode step must not
touch the host: each captured graph reads its inputs from static buffers, samples on the device and writes the
sampled token back as the next step's input (with position, slot and context length derived on the device).
One host round trip then runs up to MAX_DECODE_STEPS steps back to back, bounded by the KV slots each sequence
owns (the engine keeps lookahead_tokens of them allocated past its end) and by its remaining max_tokens; the engine
is handed one token per step from that look-ahead. The next chunk is queued on the device before the host waits for
the current one, so the GPU decodes on while the engine consumes the tokens (if the batch changes meanwhile, the
chunk in flight is dropped: its KV writes land in slots their sequences own, before anything queued later).
Sampling noise is keyed by (seed, position), so the look-ahead tokens are exactly the tokens that step-by-step
decoding would draw.

With n-gram speculative decoding the runner drafts and verifies by itself, on the device (the engine drafts
nothing): a "spec chunk" replays up to SPEC_CHUNK_STEPS verify steps in one round trip. Each drafts from the
sequence's own history (DeviceNgramDrafter, drafting.py: the NgramRule lookup in Triton), runs K + 1 query rows
per sequence (each attending as a decode row of its own, so the numbers are decode's), samples every row, accepts
the drafts up to the first that differs from the target's sample and appends the samples to the history. What
comes back is a look-ahead like decode's: the tokens plain decoding gives, only sooner. The history and counters
stay on the device, so the next spec chunk is queued behind the copy of the current one just as decode's is. Spec
chunks or plain decode chunks, whichever delivered tokens faster lately. MTP drafts the same way from the
checkpoint's module (DeviceMtpDrafter, mtp_graphs.py), which also catches up inside decode steps and after eager
ones. Prefill, mixed batches and batches larger than the largest bucket run eagerly on the same fused kernels.
"""

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from flashnext.core.engine.runner import ModelRunner, RunnerSetup, RunnerStats, StepInput, StepInputs, StepResult
from flashnext.core.engine.scheduler import ScheduledSeq
from flashnext.core.engine.sequence import Sequence
from flashnext.core.kernels import AttentionMetadata, SamplingTensors
from flashnext.core.profile import Profile
from flashnext.core.spec.decoder import accepted_length
from flashnext.core.spec.ngram import MIN_NGRAM, lookup

from .drafting import SPEC_STAT_FIELDS, SPEC_STOP_IDS, DeviceNgramDrafter
from .forward import forward, forward_unnormed, greedy_keys_of, logits_of
from .launch import GEMV_MAX_ROWS, LARGE_GEMV_MAX_ROWS, LONG_GEMV_MAX_ROWS, argmax_chunks
from .mtp_graphs import DeviceMtpDrafter

MAX_DECODE_STEPS = 16
# Decode attention splits each sequence's context until the step has this many (sequence, kv head, split) programs.
SPLIT_MIN_PROGRAMS = 256
# Device verify steps per round trip in a spec chunk (each yields 1 to K + 1 tokens).
SPEC_CHUNK_STEPS = 8
# Drafts a verify step takes in a probe, the kind chooser's retry of spec chunks while decode chunks lead: probes
# run a graph of PROBE_DRAFTS + 1 verify rows a sequence, the cheapest round of any K (K = 3's verify step costs
# 1.77 decode steps, K = 1's 1.30 on an H100), which breaks even at a lower acceptance than more drafts would, so a
# text that turned draftable still wins its probe, and the full-width graph takes over from the next chunk.
PROBE_DRAFTS = 1
# Spec chunks run only while they deliver tokens faster than plain decode chunks, both measured here per batch
# size: tokens the engine took from a round trip's look-ahead over the wall time until the next round trip (the
# host's share included; rounds with a graph capture excluded). What a verify step costs against a decode step
# depends on the model, the batch and the GPU, and what it yields on the text. The losing kind is retried (for two
# round trips): a losing spec after SPEC_RETRY round trips, then twice as many, up to SPEC_MAX_RETRY, as the text
# may have turned copyable; a losing decode once after 2 * SPEC_RETRY, then only every SPEC_MAX_RETRY, as its rate
# does not depend on the text (retrying it as often cost short copy-heavy requests a share of their speed: 32
# decode steps among ~4 spec round trips). For the same reason a decode round faster than the decode rate sets
# it: a slower one is what a host hiccup makes, so it only pulls the rate down by RATE_SMOOTHING.
SPEC_RETRY, SPEC_MAX_RETRY = 8, 128
RATE_SMOOTHING = 0.5
# While decode wins, each decode round's tokens are replayed through the n-gram drafter on the host (copy_yield:
# what verify steps would have gained on them); when that, at the rate verify steps were last measured to run,
# beats the decode rate by this margin, it becomes spec's rate, so spec takes over at once and its own rounds
# correct the estimate. (A copy-heavy request after free-form ones otherwise waited for spec's next retry, 8 to 128
# decode rounds, no faster than decode.) The margin covers steps with drafts costing more than those the rate was
# likely measured on, free-form text's, mostly without (docs/architecture.md).
SPEC_ESTIMATE_MARGIN = 1.5
_SEED_MASK = (1 << 62) - 1
# Integer inputs packed in one pinned buffer so a chunk costs one host-to-device copy: rows of _INT_FIELDS.
_INT_FIELDS = ("input_ids", "positions", "valid", "request_seed", "top_k")
_FLOAT_FIELDS = ("temperature", "top_p")
_VERIFY_INT_FIELDS = ("input_ids", "positions", "slots", "noise_seed", "top_k")
# Per-sequence state of a spec chunk: tokens known (history length), the length it stops at, the last position
# whose KV slot it owns, the request seed.
_SPEC_FIELDS = ("ntok", "cap", "max_pos", "request_seed")


def graph_buckets(sizes: list[int], max_num_seqs: int) -> list[int]:
    """The decode graphs' batch sizes: the profile's, a size past max_num_seqs standing for max_num_seqs itself, so
    that a batch between the last size under it and max_num_seqs pads to a graph instead of running eagerly, at a
    fraction of a graph's speed."""
    return sorted({min(b, max_num_seqs) for b in sizes if b > 0})


def copy_yield(tokens: list[int], start: int, k: int) -> float:
    """Tokens a verify step would have gained on average over tokens[start:] had spec decoded them: each step
    drafts k tokens by prompt lookup from the tokens before it, keeps those that came, and adds the next token."""
    history = np.asarray(tokens, dtype=np.int64)
    has_copy = _has_earlier_copy(history, start)
    steps, position = 0, start
    while position < len(history):
        drafts = lookup(history[:position], k) if has_copy[position - start] else []
        came = history[position : position + len(drafts)]
        position += accepted_length(drafts[: len(came)], came) + 1
        steps += 1
    return (len(history) - start) / steps if steps else 0.0


def _has_earlier_copy(history: np.ndarray, start: int) -> np.ndarray:
    """For each position p >= start, whether the MIN_NGRAM tokens before p occur earlier with a token after them
    (else lookup drafts nothing there: most positions of new text, found for all at once rather than a lookup
    call each)."""
    # A hash of each MIN_NGRAM-gram (int64 wrap-around): a false match only costs a lookup call.
    grams = history[: len(history) - MIN_NGRAM + 1]
    for j in range(1, MIN_NGRAM):
        grams = grams * 1_000_003 + history[j : len(history) - MIN_NGRAM + 1 + j]
    unique, first = np.unique(grams, return_index=True)
    positions = np.arange(start, len(history))
    ends = positions - MIN_NGRAM  # the gram before p starts here
    valid = ends >= 0
    found = first[np.searchsorted(unique, grams[np.maximum(ends, 0)])]
    return valid & (found < ends)


@dataclass
class _Lookahead:
    seqs: list[Sequence]
    start_positions: list[int]
    tokens: list[np.ndarray]  # per sequence: tokens[j][s] is the token at position start + s + 1


class CudaGraphRunner(ModelRunner):
    profile: Profile = Profile(name="full", cuda_graphs=True)

    @classmethod
    def for_profile(cls, profile: Profile) -> type["CudaGraphRunner"]:
        """The engine builds runners from a class: bind the profile's graph settings to one."""
        return type(cls.__name__, (cls,), {"profile": profile})

    def __init__(self, model, setup: RunnerSetup):
        super().__init__(model, setup)
        self.kernels = model.kernels
        if self.profile.batch_invariant:
            self._batch_invariant_kernels()
        self.graph_captures = 0
        self.graph_replays = 0
        # Device memory the captures added (their pool and warm-up), outside the KV budget: the profile's
        # memory_utilization leaves the rest of the device for it and the activations (docs/benchmarks.md).
        self.graph_memory_bytes = 0
        self.decode_steps_run = 0  # device decode steps, look-ahead included
        self.max_decode_steps = MAX_DECODE_STEPS  # 1 turns the look-ahead off (same graphs, one step a round trip)
        profile = self.profile
        self.use_graphs = profile.cuda_graphs
        self.verify_len = 1 + profile.spec_tokens if profile.spec != "none" else 0  # query rows a sequence
        self.buckets = graph_buckets(profile.graph_batch_sizes, profile.max_num_seqs)
        # (bucket, greedy, step kind): "decode", "spec" (verify_len rows a sequence) or "probe" (_verify_rows)
        self.graphs: dict[tuple[int, bool, str], torch.cuda.CUDAGraph] = {}
        self._ahead: _Lookahead | None = None
        # The chunk queued after _ahead's: ("decode", (graph, steps)) or ("spec", (graph key, steps)).
        self._in_flight: tuple[str, tuple] | None = None
        # The kind the chooser, asked while queueing, picked for the round after a chunk it queued nothing behind.
        self._next_kind: str | None = None
        self.use_graphs = self.use_graphs and bool(self.buckets)
        # Spec chunks for batches up to spec_max_batch (row-invariant buckets, so their tokens are decode's).
        spec_buckets = [b for b in self.buckets if b <= profile.spec_max_batch]
        self.spec_rows = max(spec_buckets) if self.use_graphs and self.verify_len and spec_buckets else 0
        if model.parallel is not None:  # the chooser times its rounds: ranks would pick apart; the engine drafts
            self.spec_rows = 0
        # Two chunks ahead (the one read and the one in flight), decode or spec at their most.
        spec_ahead = 2 * SPEC_CHUNK_STEPS * self.verify_len if self.spec_rows else 0
        self.lookahead_tokens = max(2 * MAX_DECODE_STEPS, spec_ahead) if self.use_graphs else 0
        self.chunk_rates: dict[int, dict[str, float]] = {}  # batch size: kind: tokens per second, smoothed
        self.verify_step_rates: dict[int, float] = {}  # batch size: verify steps a second when spec's rate was set
        self._round: tuple[str, float, int] | None = None  # the look-ahead's graph kind, start time, captures so far
        self.retry_wait, self.retry_next = 0, SPEC_RETRY
        self.spec_winning: bool | None = None  # which kind the rates favoured when last asked (None: not yet)
        self.probe_left, self.probe_spec = 0, False  # a retry's second round, and its kind
        self.spec_step_yield = 1.0  # tokens a sequence gained per verify step lately (smoothed): sizes spec chunks
        if self.use_graphs:
            self._init_static(max(self.buckets))
        if self.spec_rows:
            self.device_drafter = self._device_drafter(setup)

    def _device_drafter(self, setup: RunnerSetup) -> DeviceNgramDrafter | DeviceMtpDrafter:
        if self.profile.spec == "mtp":
            max_context = self.table_width * self.block_size
            return DeviceMtpDrafter(self.model, setup, self.verify_len - 1, self.spec_rows, max_context, self.profile)
        return DeviceNgramDrafter(self.kernels, self.verify_len - 1)

    @classmethod
    def kv_bytes_per_block(cls, model, block_size: int, kv_dtype: torch.dtype) -> int:
        """The target's KV, and with MTP drafting in the graphs the module's state at each slot."""
        mtp_graphs = cls.profile.spec == "mtp" and cls.profile.cuda_graphs
        states = DeviceMtpDrafter.state_bytes_per_block(model, block_size) if mtp_graphs else 0
        return super().kv_bytes_per_block(model, block_size, kv_dtype) + states

    def _init_static(self, rows: int) -> None:
        cfg, dev = self.model.config, self.device
        max_len = min(self.profile.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.table_width = -(-max_len // self.block_size)
        cuda = dev.type == "cuda"  # the CPU tests run the step bodies eagerly, without graphs
        pinned = {"pin_memory": cuda}
        self.host_ints = torch.zeros(len(_INT_FIELDS), rows, dtype=torch.int64, **pinned)
        self.host_floats = torch.zeros(len(_FLOAT_FIELDS), rows, dtype=torch.float32, **pinned)
        self.host_tables = torch.zeros(rows, self.table_width, dtype=torch.int32, **pinned)
        self.host_out = torch.zeros(MAX_DECODE_STEPS, rows, dtype=torch.int64, **pinned)
        self.dev_ints = self.host_ints.to(dev)
        self.dev_floats = self.host_floats.to(dev)
        self.dev_tables = self.host_tables.to(dev)
        self.out_tokens = torch.zeros(MAX_DECODE_STEPS, rows, dtype=torch.int64, device=dev)
        self.step_index = torch.zeros(1, dtype=torch.int64, device=dev)
        self.query_start = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        # A greedy decode step's argmax keys: zeros between steps (decode_advance hands them back so).
        self.greedy_keys = torch.zeros(rows, argmax_chunks(cfg.vocab_size), dtype=torch.int64, device=dev)
        if self.spec_rows:
            r, width = self.spec_rows, self.table_width * self.block_size
            t = r * self.verify_len  # verify rows: K + 1 a sequence
            self.host_verify_ints = torch.zeros(len(_VERIFY_INT_FIELDS), t, dtype=torch.int64, **pinned)
            self.host_verify_floats = torch.zeros(len(_FLOAT_FIELDS), t, dtype=torch.float32, **pinned)
            self.dev_verify_ints = self.host_verify_ints.to(dev)
            self.dev_verify_floats = self.host_verify_floats.to(dev)
            self.dev_context = torch.zeros(t, dtype=torch.int32, device=dev)  # per row: it attends as decode
            self.verify_query_start = torch.arange(t + 1, dtype=torch.int32, device=dev)
            self.host_hist = torch.zeros(r, width, dtype=torch.int64, **pinned)
            self.host_spec = torch.zeros(len(_SPEC_FIELDS), r, dtype=torch.int64, **pinned)
            self.host_spec_stats = torch.zeros(r, SPEC_STAT_FIELDS + self.verify_len - 1, dtype=torch.int64, **pinned)
            self.dev_hist = self.host_hist.to(dev)
            self.dev_spec = self.host_spec.to(dev)
            self.dev_spec_stats = self.host_spec_stats.to(dev)
            self.dev_n_draft = torch.zeros(r, dtype=torch.int32, device=dev)
            self.host_stops = torch.full((r, SPEC_STOP_IDS), -1, dtype=torch.int64, **pinned)
            self.dev_stops = self.host_stops.to(dev)
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        self.copy_done = torch.cuda.Event() if cuda else None

    # --- the step ------------------------------------------------------------------------------------------
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        return forward(self.model, self.kernels, inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)

    def stats(self) -> RunnerStats:
        drafter = self.device_drafter
        return RunnerStats(
            self.graph_captures,
            self.graph_replays,
            self.graph_memory_bytes,
            self.warm_up_s,
            spec_path="graphs" if drafter else "",
            spec_graph_steps=int(drafter.totals[0]) if drafter else 0,
        )

    def step(self, inputs: StepInput) -> StepResult:
        batch = inputs.batch
        if self.use_graphs and len(batch) <= self.buckets[-1]:
            cached = self._from_lookahead(batch)
            if cached is not None:
                return StepResult(cached)
            self._in_flight = None
            self._close_round(counted=False)  # nothing was queued behind it: the host's share did not overlap
            if all(i.num_tokens == 1 and i.num_logits == 1 for i in batch):
                wanted = self._next_kind == "spec" if self._next_kind else self._spec_chunk_wanted(batch)
                spec = self._spec_possible(batch) and wanted
                self._next_kind = None
                if spec:
                    rows = self._spec_chunk(batch)
                    if rows is not None:
                        return StepResult(rows)
                return StepResult(self._decode(batch))
        self._close_round(counted=False)
        self._ahead, self._in_flight = None, None
        if self.device_drafter is None:
            return super().step(inputs)
        result = super().step(StepInput(batch, want_hidden=True))  # the drafter catches up from the hidden states
        self.device_drafter.after_eager(batch, result.hidden, result.sampled)
        return result

    def _decode(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        self._round = ("decode", time.perf_counter(), self.graph_captures)
        steps = self._chunk_steps(batch)
        bucket = next(b for b in self.buckets if b >= len(batch))
        greedy = all(item.seq.params.temperature == 0 for item in batch)
        self._ensure_graphs(batch, bucket, greedy)
        self._fill_inputs(batch, bucket)
        if self.device_drafter:
            self.device_drafter.before_decode(batch)
        graph = self.graphs[(bucket, greedy, "decode")]
        self._replay_decode(graph, steps)
        return self._read_chunk(batch, graph, steps)

    def _replay_decode(self, graph: torch.cuda.CUDAGraph, steps: int) -> None:
        self.step_index.zero_()
        for _ in range(steps):
            graph.replay()
        self.graph_replays += steps
        self.decode_steps_run += steps

    def _read_chunk(self, batch: list[ScheduledSeq], graph: torch.cuda.CUDAGraph, steps: int) -> torch.Tensor:
        """The replayed chunk's tokens become the look-ahead (its first step's tokens are returned); the next chunk
        is queued behind their copy first."""

        def queue_next():
            following = self._chunk_steps(batch, done=steps)
            if following > 0 and self.spec_rows and self._spec_chunk_wanted(batch):  # each chunk is a round
                self._next_kind, following = "spec", 0
            self._in_flight = ("decode", (graph, following)) if following > 0 else None
            if self._in_flight:
                # The engine grew the tables since the last upload. (Should the copy for the chunk before still
                # be pending, it reads these longer tables: the same blocks, more of them.)
                self._upload_tables(batch)
                self._replay_decode(graph, following)

        tokens = self._to_host(self.out_tokens, self.host_out, meanwhile=queue_next)[:steps, : len(batch)].copy()
        self._ahead = _Lookahead([i.seq for i in batch], [i.seq.num_computed for i in batch], list(tokens.T))
        return torch.from_numpy(tokens[0])

    def _continue_in_flight(self, batch: list[ScheduledSeq]) -> torch.Tensor | None:
        """The look-ahead is spent and the chunk queued behind it holds the next tokens: it becomes the look-ahead
        (a round of its own for the kind chooser) and the chunk after it is queued."""
        kind, queued = self._in_flight
        self._in_flight = None
        self._close_round()
        if kind == "spec":
            key, steps = queued
            self._round = (key[2], time.perf_counter(), self.graph_captures)
            return self._read_spec(batch, key, steps, [i.seq.num_computed + 1 for i in batch])
        graph, steps = queued
        self._round = (kind, time.perf_counter(), self.graph_captures)
        return self._read_chunk(batch, graph, steps)

    def _from_lookahead(self, batch: list[ScheduledSeq]) -> torch.Tensor | None:
        """Each sequence's next token read off the look-ahead when it holds them all: the batch that made it, each
        sequence some steps further on, its KV written up to the token it sends."""
        ahead = self._ahead
        if ahead is None or len(batch) != len(ahead.seqs):
            return None
        steps: list[int] = []
        for j, item in enumerate(batch):
            seq, column = item.seq, ahead.tokens[j]
            step = seq.num_computed - ahead.start_positions[j]  # the step that sampled the token after the last
            if (
                seq is not ahead.seqs[j]
                or item.num_tokens != 1
                or item.num_logits != 1
                or not 0 <= step <= len(column)
                or (step and seq.token_ids[seq.num_computed] != column[step - 1])
            ):
                return None
            steps.append(step)
        spent = [step == len(column) for step, column in zip(steps, ahead.tokens)]
        if all(spent) and self._in_flight is not None:
            return self._continue_in_flight(batch)
        if any(spent):
            return None
        return torch.tensor([int(column[step]) for step, column in zip(steps, ahead.tokens)], dtype=torch.int64)

    def _chunk_steps(self, batch: list[ScheduledSeq], done: int = 0) -> int:
        """Steps, after `done` more, whose KV slots every sequence already owns and whose tokens every sequence
        still wants (the step the engine scheduled always has its slot)."""
        steps = self.max_decode_steps
        for item in batch:
            seq = item.seq
            room = len(seq.block_table) * self.block_size - seq.num_computed - done
            wanted = seq.tokens_left - done
            steps = min(steps, room, wanted)
        return steps if done else max(steps, 1)

    def _to_host(self, tokens: torch.Tensor, host: torch.Tensor, meanwhile=None) -> np.ndarray:
        """The round trip's one host sync; `meanwhile` queues more device work behind the copy before the wait."""
        host.copy_(tokens, non_blocking=True)
        self.copy_done.record()
        if meanwhile is not None:
            meanwhile()
        self.copy_done.synchronize()
        return host.numpy()

    def _fill_inputs(self, batch: list[ScheduledSeq], bucket: int) -> None:
        ints, floats = self.host_ints.numpy(), self.host_floats.numpy()
        ints[:, :bucket] = 0
        floats[0, :bucket], floats[1, :bucket] = 0.0, 1.0
        for j, item in enumerate(batch):
            seq = item.seq
            ints[:, j] = (seq.token_ids[seq.num_computed], seq.num_computed, 1, seq.seed, seq.params.top_k)
            floats[:, j] = (seq.params.temperature, seq.params.top_p)
        self.dev_ints.copy_(self.host_ints, non_blocking=True)
        self.dev_floats.copy_(self.host_floats, non_blocking=True)
        self._upload_tables(batch)

    def _upload_tables(self, batch: list[ScheduledSeq]) -> None:
        """The sequences' block tables as they are now (the engine grows them as they advance)."""
        tables = self.host_tables.numpy()
        for j, item in enumerate(batch):
            tables[j, : len(item.seq.block_table)] = item.seq.block_table
        self.dev_tables[: len(batch)].copy_(self.host_tables[: len(batch)], non_blocking=True)

    # --- capture -------------------------------------------------------------------------------------------
    def _ensure_graphs(self, batch: list[ScheduledSeq], bucket: int, greedy: bool) -> None:
        """The bucket's decode graph, and its verify graph where speculation may run, captured together: the kind
        chooser switches kinds mid-request, and a capture then would stall that request for seconds. (The
        captures' warm-ups step the buffers: callers fill their inputs afterwards.)"""
        if (bucket, greedy, "decode") not in self.graphs:
            self._fill_inputs(batch, bucket)
            self._capture((bucket, greedy, "decode"), lambda: self._decode_body(bucket, greedy), 1)
        if not self._spec_possible(batch):
            return
        missing = [
            kind for kind in dict.fromkeys(("spec", self._probe_kind())) if (bucket, greedy, kind) not in self.graphs
        ]
        # Before a GPU runner's first spec capture: the drafter's eager first uses, out of the requests' way.
        if missing and self.pool is not None and not any(key[2] == "spec" for key in self.graphs):
            started = time.perf_counter()
            self.device_drafter.warm_up()
            self.warm_up_s += time.perf_counter() - started
        for kind in missing:
            q = self._verify_rows(kind)
            self._fill_spec(batch, bucket, q)
            self._capture((bucket, greedy, kind), lambda q=q: self._spec_body(bucket, greedy, q), q)

    def _batch_invariant_kernels(self) -> None:
        """Profile batch_invariant: one route for every row count, eager steps and graphs alike, so a row's numbers
        do not depend on what shares its step: every projection through the skinny GEMM in 16-row tiles with one
        configuration (no register GEMV, whose route ends at a row count; no cuBLAS, whose kernel and split-K follow
        M), attention unsplit with the prompt rows' tiles (graph_settings then changes nothing)."""
        k = self.kernels
        k.row_invariant = k.batch_invariant = True
        k.gemv_max_rows = k.large_gemv_rows = k.long_gemv_rows = 0
        k.decode_splits = 1

    def _splits(self, bucket: int) -> int:
        """KV splits so that a small decode batch still gives the GPU a few hundred attention programs."""
        programs = bucket * self.model.config.num_kv_heads
        splits = 1
        while splits < 16 and programs * splits < SPLIT_MIN_PROGRAMS:
            splits *= 2
        return splits

    def _row_invariant(self, bucket: int) -> bool:
        """Graphs of this bucket compute each row the same way whatever the step's row count (the register GEMV
        for every projection, the skinny GEMM's 16-row tiles for the vocabulary, attention per row), with or
        without speculation: a verify step then reproduces decode's numbers bit for bit, so 16-bit speculative
        decoding is token-identical to plain decoding. Up to spec_max_batch sequences, where speculation runs."""
        return bucket <= self.profile.spec_max_batch

    @contextmanager
    def graph_settings(self, bucket: int, query_rows: int):
        """The kernel settings a graph of this bucket is captured with (split count, row-invariant GEMV), restored
        to the eager defaults afterwards."""
        kernels = self.kernels
        if kernels.batch_invariant:  # one route for every batch already (_batch_invariant_kernels)
            yield
            return
        kernels.decode_splits = self._splits(bucket)
        if self._row_invariant(bucket):
            kernels.gemv_max_rows, kernels.row_invariant = max(GEMV_MAX_ROWS, bucket * query_rows), True
            # Large weights and long int4 rows (see LARGE_WEIGHT, LONG_GEMV_MAX_K): the GEMV for every row of a
            # one-sequence graph, decode and verify alike; the skinny GEMM's 16-row tiles for every row of larger
            # buckets, where the GEMV would read the weight once a row.
            kernels.large_gemv_rows = bucket * query_rows if bucket == 1 else 0
            # Long 16-bit and fp8 rows: the GEMV for a one-row step unless verify steps share its route (the GEMV
            # would read the weight once a verify row).
            kernels.long_gemv_rows = 0 if self.verify_len else LONG_GEMV_MAX_ROWS
        try:
            yield
        finally:
            kernels.decode_splits, kernels.gemv_max_rows, kernels.row_invariant = 1, GEMV_MAX_ROWS, False
            kernels.large_gemv_rows, kernels.long_gemv_rows = LARGE_GEMV_MAX_ROWS, LONG_GEMV_MAX_ROWS

    def _capture(self, key: tuple[int, bool, str], body, query_rows: int) -> torch.cuda.CUDAGraph:
        # torch.cuda.graph empties the allocator's cache before it captures: read what is reserved after that
        # too, or a cache of freed prefill blocks hides the pool's growth (Qwen3-0.6B's captures read as 0 bytes).
        torch.cuda.empty_cache()
        reserved, started = torch.cuda.memory_reserved(self.device), time.perf_counter()
        with self.graph_settings(key[0], query_rows):
            # Warm up on a side stream (Triton compiles there), then capture; both leave only the static
            # buffers changed (the decode body advances its inputs), which the caller refills before replaying.
            # The warm-up writes its tokens at row step_index of out_tokens, which a full chunk leaves one past
            # the end (an illegal memory access, or step_index overwritten where it is the next allocation).
            self.step_index.zero_()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                body()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                body()
        self.graphs[key] = graph
        self.graph_captures += 1
        self.graph_memory_bytes += max(torch.cuda.memory_reserved(self.device) - reserved, 0)
        self.warm_up_s += time.perf_counter() - started
        return graph

    def _decode_body(self, rows: int, greedy: bool) -> None:
        """One decode step on the static buffers: model, sampling, and the next step's inputs, all on device."""
        k = self.kernels
        ids, positions, valid, request_seed, top_k = (self.dev_ints[i, :rows] for i in range(len(_INT_FIELDS)))
        temperature, top_p = self.dev_floats[0, :rows], self.dev_floats[1, :rows]
        tables = self.dev_tables[:rows]
        slots, context_lens = k.decode_inputs(positions, valid, tables, self.block_size)
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start=self.query_start[: rows + 1],
            context_lens=context_lens,
            block_tables=tables,
            max_query_len=1,
            max_context_len=self.table_width * self.block_size,
        )
        # 16-bit logits: argmax over them equals argmax over their exact fp32 widening, and sample() widens
        # itself when it needs probabilities, so the [rows, vocab] fp32 copy compute_logits makes is skipped.
        hidden, residual = forward_unnormed(self.model, k, ids, positions, meta, self.kv_caches)
        if greedy:  # the argmax's second half rides in decode_advance
            tokens = greedy_keys_of(self.model, k, hidden, residual, self.greedy_keys[:rows])
        else:
            seeds = (request_seed * 1_000_003 + positions + 1) & _SEED_MASK
            tokens = k.sample(
                logits_of(self.model, k, hidden, residual),
                SamplingTensors(temperature, top_k, top_p, seeds, all_greedy=False),
            )
        k.decode_advance(tokens, ids, positions, self.out_tokens, self.step_index)
        if self.device_drafter:
            self.device_drafter.after_decode(hidden, residual, ids, positions, meta)

    # --- spec chunks: verify steps chained on the device ------------------------------------------------------
    def _spec_possible(self, batch: list[ScheduledSeq]) -> bool:
        return 0 < len(batch) <= self.spec_rows and all(i.seq.spec_enabled for i in batch)

    def _spec_chunk_wanted(self, batch: list[ScheduledSeq]) -> bool:
        if not self._spec_possible(batch):
            return False
        if not self.profile.spec_adaptive:  # speculation never pauses
            return True
        rates = self.rates_of(len(batch))
        if not rates["spec"] or not rates["decode"]:
            return not rates["spec"]  # measure both kinds first
        winning = rates["spec"] >= rates["decode"]
        if winning != self.spec_winning:  # the first retry of the new loser comes after its first wait
            self.spec_winning = winning
            self.retry_wait, self.retry_next = 2 * SPEC_RETRY if winning else SPEC_RETRY, 2 * SPEC_RETRY
        if self.probe_left:
            self.probe_left -= 1
            return self.probe_spec
        if self.retry_wait:
            self.retry_wait -= 1
            return winning
        # The losing kind, for two rounds (the first has the second queued behind it, so its rate counts).
        if winning:
            self.retry_wait = SPEC_MAX_RETRY
        else:
            self.retry_wait, self.retry_next = self.retry_next, min(2 * self.retry_next, SPEC_MAX_RETRY)
        self.probe_left, self.probe_spec = 1, not winning
        return not winning

    def rates_of(self, rows: int) -> dict[str, float]:
        """The measured rates of both kinds of round trip for batches of `rows` (0 until measured)."""
        return self.chunk_rates.setdefault(rows, {"decode": 0.0, "spec": 0.0})

    def _close_round(self, counted: bool = True) -> None:
        """The last look-ahead is spent: its kind's rate is the tokens the engine took from it over the time since
        it began. Only a round with a chunk queued behind it counts (counted): in one without, the engine's share
        of the time ran with the GPU idle, which steady rounds of either kind overlap (the last round of each run
        of a kind is one, so counting it favoured the kind running, and a one-round retry never won)."""
        ahead, round_ = self._ahead, self._round
        self._round = None
        if not counted or ahead is None or round_ is None or self.graph_captures != round_[2]:  # nor compile time
            return
        taken = sum(
            min(max(seq.num_computed - start, 0), len(column))
            for seq, start, column in zip(ahead.seqs, ahead.start_positions, ahead.tokens)
        )
        if taken:
            rates, graph = self.rates_of(len(ahead.seqs)), round_[0]
            kind = "decode" if graph == "decode" else "spec"  # a probe's round counts for spec
            rate, old = taken / (time.perf_counter() - round_[1]), rates[kind]
            faster_decode = kind == "decode" and rate > old
            rates[kind] = old + RATE_SMOOTHING * (rate - old) if old and not faster_decode else rate
            if graph == "spec":  # over the tokens a step gave: verify steps a second, which the text hardly moves
                self.verify_step_rates[len(ahead.seqs)] = rates["spec"] / self.spec_step_yield
            elif graph == "decode" and 0 < rates["spec"] < rates["decode"] and self._estimates_spec(ahead):
                estimate = self._spec_estimate(ahead)
                if estimate > SPEC_ESTIMATE_MARGIN * rates["decode"]:
                    rates["spec"] = estimate

    def _estimates_spec(self, ahead: "_Lookahead") -> bool:
        """Whether a decode round's tokens tell what spec would yield on them: for n-gram drafts, which copy_yield
        replays (MTP's drafts come from its module: only its own rounds tell)."""
        return self.device_drafter.method == "ngram" and all(seq.spec_enabled for seq in ahead.seqs)

    def _spec_estimate(self, ahead: "_Lookahead") -> float:
        """Tokens a second spec would have given a decode round's tokens: the tokens each verify step would have
        gained on them (copy_yield, the sequences' mean) at the rate verify steps last ran."""
        yields = [
            copy_yield(seq.token_ids[: seq.num_computed + 1], start + 1, self.verify_len - 1)
            for seq, start in zip(ahead.seqs, ahead.start_positions)
            if seq.num_computed > start
        ]
        return self.verify_step_rates.get(len(ahead.seqs), 0.0) * float(np.mean(yields)) if yields else 0.0

    def _probe_kind(self) -> str:
        """The graph a probe runs: "probe" where the spec graph is wider than PROBE_DRAFTS drafts."""
        return "probe" if self.verify_len > PROBE_DRAFTS + 1 else "spec"

    def _spec_kind(self) -> str:
        """The graph the next spec chunk runs: a probe's while decode chunks lead, else the full-width one."""
        return self._probe_kind() if self.spec_winning is False else "spec"

    def _verify_rows(self, kind: str) -> int:
        return PROBE_DRAFTS + 1 if kind == "probe" else self.verify_len

    def _spec_chunk(self, batch: list[ScheduledSeq]) -> torch.Tensor | None:
        """Up to SPEC_CHUNK_STEPS device verify steps, then the rows this batch asks for, off the look-ahead."""
        # Work the drafter owes the decode chunks before (MTP's catch-up) is the switch's cost, not spec's rate.
        self.device_drafter.before_spec(batch)
        bucket = next(b for b in self.buckets if b >= len(batch))
        greedy = all(item.seq.params.temperature == 0 for item in batch)
        key = (bucket, greedy, self._spec_kind())
        self._round = (key[2], time.perf_counter(), self.graph_captures)
        self._ensure_graphs(batch, bucket, greedy)
        starts = self._fill_spec(batch, bucket, self._verify_rows(key[2]))
        steps = self._spec_steps(batch)
        self._replay_spec(key, steps)
        return self._read_spec(batch, key, steps, starts)

    def _spec_steps(self, batch: list[ScheduledSeq], ahead: float = 0.0) -> int:
        """Verify steps for a spec chunk: as many as the sequence wanting the most tokens needs at the recent yield
        per step, beyond `ahead` tokens the chunk before it should give (a step past every sequence's end costs a
        whole step all the same); at most SPEC_CHUNK_STEPS, 0 when nothing is left to want."""
        wanted = max(i.seq.tokens_left for i in batch) - ahead
        return min(SPEC_CHUNK_STEPS, max(0, math.ceil(wanted / self.spec_step_yield)))

    def _replay_spec(self, key: tuple[int, bool, str], steps: int) -> None:
        graph = self.graphs[key]
        for _ in range(steps):
            graph.replay()
        self.graph_replays += steps

    def _read_spec(
        self, batch: list[ScheduledSeq], key: tuple[int, bool, str], steps: int, starts: list[int]
    ) -> torch.Tensor | None:
        """The replayed spec chunk's tokens (history from `starts` on) become the look-ahead; the next spec chunk is
        queued behind their copy when the chooser wants one (it continues from the device's history)."""
        bucket = key[0]
        end = min(max(starts) + steps * self._verify_rows(key[2]), self.host_hist.shape[1])
        self.host_spec[0, :bucket].copy_(self.dev_spec[0, :bucket], non_blocking=True)
        self.host_spec_stats[:bucket].copy_(self.dev_spec_stats[:bucket], non_blocking=True)

        def queue_next():
            following = self._spec_steps(batch, ahead=steps * self.spec_step_yield)
            spec = following > 0 and self._spec_chunk_wanted(batch)
            if spec and key[2] != self._spec_kind():
                self._next_kind = "spec"  # a chunk of the other width: its inputs laid out afresh
            elif spec:
                self.dev_spec_stats[:bucket].zero_()  # each chunk's counters are read once
                self._grant_slots(batch)
                self._replay_spec(key, following)
                self._in_flight = ("spec", (key, following))
            elif following:
                self._next_kind = "decode"

        hist = self._to_host(self.dev_hist[:bucket, :end], self.host_hist[:bucket, :end], meanwhile=queue_next)
        ntok, stats = self.host_spec.numpy()[0], self.host_spec_stats.numpy()[:bucket].sum(axis=0)
        self.device_drafter.after_chunk(batch, self.host_spec_stats.numpy()[: len(batch)])
        self.device_drafter.totals += stats
        if stats[0]:  # verify steps taken, and the tokens they gave: one each plus the accepted drafts
            step_yield = (stats[0] + stats[3]) / stats[0]
            self.spec_step_yield += RATE_SMOOTHING * (step_yield - self.spec_step_yield)
        tokens = [hist[j, start : ntok[j]].copy() for j, start in enumerate(starts)]
        if not all(len(t) for t in tokens):  # a sequence out of slots or tokens: the host takes over
            self._in_flight, self._ahead, self._round = None, None, None
            return None
        self._ahead = _Lookahead([i.seq for i in batch], [start - 1 for start in starts], tokens)
        return self._from_lookahead(batch)

    def _grant_slots(self, batch: list[ScheduledSeq]) -> None:
        """Each sequence's last writable position and block table as the engine has grown them since the chunk
        before was queued."""
        max_pos = self.host_spec.numpy()[2]
        for j, item in enumerate(batch):
            max_pos[j] = self._last_writable(item.seq)
        self.dev_spec[2, : len(batch)].copy_(self.host_spec[2, : len(batch)], non_blocking=True)
        self.device_drafter.before_chunk(batch)
        self._upload_tables(batch)

    def _last_writable(self, seq: Sequence) -> int:
        """The last position a spec chunk may write for seq: the engine keeps lookahead_tokens slots (two chunks'
        worth) allocated past the tokens it has taken, from free blocks only."""
        return min(len(seq.block_table) * self.block_size, seq.num_computed + 1 + self.lookahead_tokens) - 1

    def _fill_spec(self, batch: list[ScheduledSeq], bucket: int, q: int | None = None) -> list[int]:
        """Each sequence's history, limits and sampling settings into the buffers of a chunk of q verify rows a
        sequence (verify_len unless given); returns the history lengths (the look-ahead starts after them)."""
        q = q or self.verify_len
        hist, state = self.host_hist.numpy(), self.host_spec.numpy()
        ints, floats = self.host_verify_ints.numpy(), self.host_verify_floats.numpy()
        state[:, :bucket] = 0  # idle rows: an empty history takes no step
        ints[4, : bucket * q] = 0
        floats[0, : bucket * q], floats[1, : bucket * q] = 0.0, 1.0
        max_len = self.table_width * self.block_size
        starts = []
        for j, item in enumerate(batch):
            seq = item.seq
            n = seq.num_computed + 1  # the last known token is not in the KV cache yet
            hist[j, :n] = seq.token_ids[:n]
            state[:, j] = (n, min(n + seq.tokens_left, max_len), self._last_writable(seq), seq.seed)
            rows = slice(j * q, (j + 1) * q)
            ints[4, rows] = seq.params.top_k
            floats[:, rows] = ((seq.params.temperature,), (seq.params.top_p,))
            self._fill_stops(j, seq)
            starts.append(n)
        width = max(starts)
        self.dev_hist[:bucket, :width].copy_(self.host_hist[:bucket, :width], non_blocking=True)
        self.dev_stops[:bucket].copy_(self.host_stops[:bucket], non_blocking=True)
        self.dev_spec[:, :bucket].copy_(self.host_spec[:, :bucket], non_blocking=True)
        self.dev_spec_stats[:bucket].zero_()
        self.dev_verify_ints[4, : bucket * q].copy_(self.host_verify_ints[4, : bucket * q], non_blocking=True)
        self.dev_verify_floats[:, : bucket * q].copy_(self.host_verify_floats[:, : bucket * q], non_blocking=True)
        self.device_drafter.before_chunk(batch)
        self._upload_tables(batch)
        return starts

    def _fill_stops(self, row: int, seq: Sequence) -> None:
        """The tokens the device ends row `row` at: the engine's stop tokens for seq (EOS first), as many as fit.
        Any the device misses the engine still stops at; the device only saves the chunk's steps past them."""
        stops = seq.params.stop_ids(self.eos_ids)[:SPEC_STOP_IDS]
        host = self.host_stops.numpy()
        host[row] = -1
        host[row, : len(stops)] = stops

    def _spec_body(self, rows: int, greedy: bool, q: int | None = None) -> None:
        """One device verify step of a spec chunk: draft, verify q = K + 1 rows a sequence (verify_len unless given;
        as decode rows), accept. The drafter reads K off the rows' layout."""
        k, q = self.kernels, q or self.verify_len
        t = rows * q
        ids, positions, slots, seeds, top_k = (self.dev_verify_ints[i, :t] for i in range(len(_VERIFY_INT_FIELDS)))
        ntok, cap, max_pos, request_seed = (self.dev_spec[i, :rows] for i in range(len(_SPEC_FIELDS)))
        hist, n_draft, context = self.dev_hist[:rows], self.dev_n_draft[:rows], self.dev_context[:t]
        self.device_drafter.draft(
            (hist, ntok, cap, max_pos, request_seed, n_draft),
            (ids, positions, slots, context, seeds),
            self.dev_tables[:rows],
            self.block_size,
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start=self.verify_query_start[: t + 1],
            context_lens=context,
            block_tables=self.dev_tables[:rows],
            max_query_len=1,
            max_context_len=self.table_width * self.block_size,
        )
        hidden, residual = forward_unnormed(self.model, k, ids, positions, meta, self.kv_caches)
        logits = logits_of(self.model, k, hidden, residual)
        temperature, top_p = self.dev_verify_floats[0, :t], self.dev_verify_floats[1, :t]
        if greedy:  # the argmax's second half rides in spec_accept
            sampled = k.argmax_keys(logits)
        else:
            sampled = k.sample(logits, SamplingTensors(temperature, top_k, top_p, seeds, all_greedy=False))
        self.device_drafter.accept(
            sampled, ids, hist, ntok, cap, n_draft, self.dev_spec_stats[:rows], self.dev_stops[:rows]
        )
        verify = (ids, positions, slots, context, seeds)
        self.device_drafter.after_verify(hidden, residual, verify, hist, ntok, self.dev_tables[:rows])
