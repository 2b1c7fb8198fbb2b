"""The engine loop: schedule, run the model, append sampled tokens, retire finished requests."""

from dataclasses import dataclass

from ..backend import Backend
from ..errors import EMPTY_PROMPT, UserError
from ..loader import LoadedModel
from ..model import prefill_token_bytes, weight_bytes
from ..precision import PRECISIONS
from ..profile import MIN_BATCHED_TOKENS, Profile
from ..spec.decoder import SpecDecoder, SpecStats
from ..spec.mtp import MtpDrafter, MtpModule
from .block_manager import BlockManager
from .runner import Runner, RunnerSetup, StepInput, StepResult
from .scheduler import ScheduledSeq, Scheduler
from .sequence import SamplingParams, Sequence, Status

GIB = 1 << 30


@dataclass
class StepOutput:
    seq: Sequence
    new_token_ids: list[int]
    finished: bool
    error: str | None = None  # why the step failed this request (its finish_reason is then "error")


class LLMEngine:
    def __init__(self, backend: Backend, loaded: LoadedModel, precision: str | None, profile: Profile, parallel=None):
        self.backend, self.config = backend, loaded.config
        self.parallel = parallel  # a TensorParallel (core/parallel.py) when loaded holds one rank's shard
        self.precision = backend.check_request(precision or backend.preferred_precision(loaded.weights), profile)
        self.profile = profile = self._within_capabilities(profile)
        backend.prepare_engine(self.precision, profile)
        if not backend.capabilities.unified_memory:
            self._refuse_weights_past_free_memory(backend, loaded)
        self.model = backend.build_model(loaded, self.precision, profile, self._quantized_head(backend, profile))
        if parallel:
            parallel.attach(self.model)
        # The model's own config: an exported graph's context may be shorter than the checkpoint's.
        limit = self.model.config.max_position_embeddings
        self.max_model_len = min(profile.max_model_len or limit, limit)
        runner_class = backend.runner_class(profile)
        self.kv_dtype = (
            runner_class.auto_kv_dtype(self.model)
            if profile.kv_cache_dtype == "auto"
            else PRECISIONS[profile.kv_cache_dtype].storage_dtype
        )
        self.mtp = MtpModule(self.model, loaded.weights) if profile.spec == "mtp" else None
        block_bytes = runner_class.kv_bytes_per_block(self.model, profile.block_size, self.kv_dtype)
        if profile.spec == "mtp":  # the MTP module keeps its own KV in the same block layout
            block_bytes += MtpDrafter.kv_bytes_per_block(self.model, profile.block_size, self.kv_dtype)
        num_blocks = self._num_blocks(block_bytes, self._activation_peak(runner_class))
        if parallel:
            num_blocks = parallel.agreed_blocks(num_blocks)
        self.eos_ids = set(loaded.config.eos_token_ids) | set(loaded.tokenizer.eos_token_ids)
        setup = RunnerSetup(num_blocks, profile.block_size, self.kv_dtype, frozenset(self.eos_ids), self.mtp)
        self.runner: Runner = runner_class(self.model, setup)
        self.blocks = BlockManager(num_blocks, profile.block_size, profile.prefix_caching)
        self.scheduler = Scheduler(self.blocks, profile.max_num_seqs, profile.max_num_batched_tokens)
        self.spec = (
            None
            if profile.spec == "none"
            else SpecDecoder(
                profile,
                self.mtp,
                self.blocks,
                self.kv_dtype,
                self.max_model_len,
                device_drafter=self.runner.device_drafter,
            )
        )

    def _within_capabilities(self, profile: Profile) -> Profile:
        """The profile bounded by the backend's declarations: prefix caching only where declared, a static-shape
        backend's batch, prompt chunk and context, a maximum concurrency or request length. Requests past them queue
        or are refused, never fail."""
        caps = self.backend.capabilities
        shapes = caps.static_shapes
        limits = {
            "max_num_seqs": [caps.max_concurrency, shapes and shapes.batch],
            "max_model_len": [caps.max_tokens_per_request, shapes and shapes.max_context],
            # One sequence's prompt piece fits the fixed chunk when the whole step's budget does.
            "max_num_batched_tokens": [shapes and shapes.prefill_chunk],
        }
        changes = {} if caps.prefix_caching else {"prefix_caching": False}
        for name, bounds in limits.items():
            bounds = [b for b in bounds if b]
            if bounds:
                current = getattr(profile, name)
                changes[name] = min([current, *bounds]) if current is not None else min(bounds)
        if shapes:  # prompts longer than the chunk are always cut into chunks
            changes["chunked_prefill"] = True
        # Limits set by hardware may be under the profile's own floors (a 16-token budget): applied unvalidated.
        return profile.model_copy(update=changes) if changes else profile

    def _refuse_weights_past_free_memory(self, backend: Backend, loaded: LoadedModel) -> None:
        """A model bound for an accelerator that cannot hold its weights and one full prefill chunk (the chunk's KV
        cache and activations, and a row of float32 logits) is refused up front, naming the precisions or the chunk
        size that would fit, rather than failing out of memory half way through the load. (A device that computes
        from host memory holds the weights already: the engine skips this for a unified-memory backend.)"""
        free, profile, config = backend.free_memory_bytes(), self.profile, loaded.config
        tokens = min(profile.max_num_batched_tokens, profile.max_model_len or config.max_position_embeddings)

        def need(precision, tokens: int = tokens) -> int:
            dense = backend.activation_dtype(precision)
            kv = dense if profile.kv_cache_dtype == "auto" else PRECISIONS[profile.kv_cache_dtype].storage_dtype
            per_token = prefill_token_bytes(config, dense, kv.itemsize)
            return weight_bytes(config, loaded.weights, precision, dense) + tokens * per_token + config.vocab_size * 4

        needed = need(self.precision)
        if needed <= free:
            return
        fixes = []
        for name in ("fp8-e4m3", "int4"):
            try:
                option = backend.check_request(name, profile)
            except UserError:
                continue  # not on this device
            if option.bits < self.precision.bits and need(option) <= free:
                fixes.append(f"--precision {name} ({need(option) / GIB:.1f} GiB)")
        per_token = need(self.precision, 1) - need(self.precision, 0)
        chunk = tokens - -(-(needed - free) // per_token)
        if chunk >= MIN_BATCHED_TOKENS:
            fixes.append(f"--max-num-batched-tokens {chunk}")
        fix = f"use {' or '.join(fixes)}" if fixes else "pick a smaller model"
        raise UserError(
            f"{loaded.source}: its weights and a {tokens}-token prefill need at least {needed / GIB:.1f} GiB as "
            f"{self.precision.name} but the {backend.name} device has {free / GIB:.1f} GiB free; {fix}"
        )

    def _quantized_head(self, backend: Backend, profile: Profile) -> bool:
        """profile.quantize_lm_head where the weights are quantized (a 16-bit head is already their precision): the
        head then takes self.precision.head."""
        if not profile.quantize_lm_head or self.precision.bits >= 16:
            return False
        if not backend.quantized_head(self.precision):
            raise UserError(
                f"backend '{backend.name}' cannot keep the LM head of {self.precision.name} weights in "
                f"{self.precision.head.name} here: unset quantize_lm_head (FLASHNEXT_QUANTIZE_LM_HEAD)"
            )
        return True

    def _activation_peak(self, runner_class) -> int:
        """Peak memory of a full-budget prefill, measured by a warm-up pass over a throwaway cache."""
        tokens = min(self.profile.max_num_batched_tokens, self.max_model_len - 1)
        blocks = -(-tokens // self.profile.block_size)

        def warm_up():  # its one-prompt cache counts in the peak too: a slightly conservative budget
            seq = Sequence([i % self.config.vocab_size for i in range(tokens)], SamplingParams(max_tokens=1))
            seq.block_table = list(range(blocks))
            setup = RunnerSetup(blocks, self.profile.block_size, self.kv_dtype, mtp=self.mtp)
            runner = runner_class(self.model, setup)
            runner.step(StepInput([ScheduledSeq(seq, tokens, 1)]))

        return self.backend.peak_memory_bytes(warm_up) or 0

    def _num_blocks(self, block_bytes: int, activation_peak: int = 0) -> int:
        """Blocks that fit the memory budget (after the warm-up's activation peak), but no more than the
        configured batch could ever use."""
        budget = self.backend.kv_budget_bytes(self.profile, activation_peak)
        useful = self.profile.max_num_seqs * -(-self.max_model_len // self.profile.block_size)
        num_blocks = min(int(budget // block_bytes), useful)
        if num_blocks < 1:
            raise UserError(
                f"no memory left for the KV cache ({budget / GIB:.2f} GiB budget, {block_bytes} bytes a block);"
                " raise --memory-utilization or pick a smaller model"
            )
        return num_blocks

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str = "",
        chunked_prefill: bool | None = None,
        spec_enabled: bool = True,
    ) -> Sequence:
        if not prompt_ids:
            raise UserError(EMPTY_PROMPT)
        if len(prompt_ids) >= self.max_model_len:
            raise UserError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_model_len};"
                " shorten it or raise --max-model-len"
            )
        if len(prompt_ids) > self.blocks.num_blocks * self.blocks.block_size:
            raise UserError("the prompt does not fit the KV cache; raise the memory budget or shorten the prompt")
        params = self._capped(params)
        chunked = (
            self.profile.chunked_prefill
            if chunked_prefill is None
            else chunked_prefill and self.profile.chunked_prefill
        )
        seq = Sequence(
            list(prompt_ids), params, request_id=request_id, chunked_prefill=chunked, spec_enabled=spec_enabled
        )
        self.scheduler.add(seq)
        return seq

    def _capped(self, params: SamplingParams) -> SamplingParams:
        """max_tokens within the profile's max_tokens_cap: clamped (the request then ends with "length") or
        refused, as the profile's max_tokens_over_cap says."""
        cap = self.profile.max_tokens_cap
        if cap is None or params.max_tokens <= cap:
            return params
        if self.profile.max_tokens_over_cap == "refuse":
            raise UserError(
                f"max_tokens {params.max_tokens} is above the {cap} a request of backend "
                f"'{self.backend.name}' (profile '{self.profile.name}', max_tokens_cap); ask for at most {cap}"
            )
        return params.model_copy(update={"max_tokens": cap})

    def max_tokens_notice(self, max_tokens: int) -> str | None:
        """What the profile's max_tokens_cap does to a request asking `max_tokens`, said to its client: None when
        it runs as asked (or is refused: add_request says why)."""
        cap = self.profile.max_tokens_cap
        if cap is None or max_tokens <= cap or self.profile.max_tokens_over_cap != "clamp":
            return None
        return (
            f"max_tokens {max_tokens} lowered to {cap}: a request of backend '{self.backend.name}' (profile "
            f"'{self.profile.name}', max_tokens_cap) answers at most {cap} tokens, then ends with finish_reason length"
        )

    def abort(self, seq: Sequence) -> None:
        """Cancel a request and free its blocks at once."""
        if seq.finish_reason is None:
            self.scheduler.finish(seq, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self, isolate_failures: bool = False) -> list[StepOutput]:
        """One scheduled batch. With isolate_failures (the server), an exception fails requests instead of the
        loop: a model run that raises is retried one request at a time, so only a request that fails on its own is
        finished (reason "error", blocks freed); a failure after the tokens were taken fails the whole batch."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        if not isolate_failures:
            return self._finish_step(batch, self._run_model(batch))
        try:
            result = self._run_model(batch)
        except Exception as exc:
            if len(batch) == 1:
                return [self._fail(batch[0].seq, exc)]
            return [out for item in batch for out in self._step_alone(item)]
        try:
            return self._finish_step(batch, result)
        except Exception as exc:
            return [self._fail(item.seq, exc) for item in batch]

    def _step_alone(self, item: ScheduledSeq) -> list[StepOutput]:
        try:
            return self._finish_step([item], self._run_model([item]))
        except Exception as exc:
            return [self._fail(item.seq, exc)]

    def _fail(self, seq: Sequence, exc: Exception) -> StepOutput:
        if seq.finish_reason is None:
            seq.draft_ids = []
            self.scheduler.finish(seq, "error")
        return StepOutput(seq, [], True, error=f"{type(exc).__name__}: {exc}"[:500])

    def _run_model(self, batch: list[ScheduledSeq]) -> StepResult:
        want_hidden = self.profile.spec == "mtp"
        if self.parallel is None:
            return self.runner.step(StepInput(batch, want_hidden))
        try:
            self.parallel.send_step(batch, want_hidden)  # the other ranks run the same step
            return self.runner.step(StepInput(batch, want_hidden))
        except Exception:
            self.parallel.explain_failure()
            raise

    def _finish_step(self, batch: list[ScheduledSeq], result: StepResult) -> list[StepOutput]:
        starts = [item.seq.num_computed for item in batch]  # the runner leaves num_computed to _postprocess
        outputs = self._postprocess(batch, result.sampled.tolist())
        if self.runner.lookahead_tokens:
            self._keep_lookahead(batch)
        if self.spec:
            self.spec.after_step(batch, starts, result.hidden)
        return outputs

    def _keep_lookahead(self, batch: list[ScheduledSeq]) -> None:
        """The runner's look-ahead slots past each decoding sequence's end, from free blocks only: never at the
        cost of preempting anyone (the runner then runs fewer steps ahead)."""
        for item in batch:
            seq = item.seq
            if seq.status is Status.RUNNING and seq.num_uncomputed == 1:
                ahead = min(len(seq) + self.runner.lookahead_tokens, self.max_model_len)
                if 0 < self.blocks.blocks_needed(seq, ahead) <= self.blocks.num_free:  # once a block, on the hot path
                    self.blocks.grow(seq, ahead)

    def _postprocess(self, batch: list[ScheduledSeq], sampled: list[int]) -> list[StepOutput]:
        outputs, row = [], 0
        for item in batch:
            seq = item.seq
            drafts = seq.draft_ids
            if drafts:
                seq.draft_ids = []
            # Draft KV is kept only for accepted drafts, counted below: rejected tokens are never committed.
            seq.num_computed += item.num_tokens - len(drafts)
            new: list[int] = []
            reason = None
            if item.num_logits:
                rows = sampled[row : row + item.num_logits]
                row += item.num_logits
                for token in self.spec.accept(seq, drafts, rows) if drafts else rows[:1]:
                    new.append(token)
                    seq.token_ids.append(token)
                    reason = self._stop_reason(seq)
                    if reason:
                        break
                seq.num_computed += len(new) - 1  # accepted drafts; the last new token is computed next step
            if drafts:
                self.blocks.truncate(seq, len(seq))  # roll back the blocks of rejected drafts
            self.blocks.commit_full_blocks(seq)
            if reason:
                self.scheduler.finish(seq, reason)
            outputs.append(StepOutput(seq, new, reason is not None))
        return outputs

    def spec_stats(self) -> dict:
        """Speculative-decoding counters (drafts, drafted, accepted, accepted_per_position, mean_acceptance_length)."""
        return (self.spec.counters() if self.spec else SpecStats()).as_dict()

    def _stop_reason(self, seq: Sequence) -> str | None:
        if seq.params.stops_at(seq.token_ids[-1], self.eos_ids):
            return "stop"
        # A sequence longer than the whole KV cache could never be scheduled again, even alone.
        length = len(seq)
        too_long = length >= self.max_model_len or length > self.blocks.num_blocks * self.blocks.block_size
        if seq.tokens_left <= 0 or too_long:
            return "length"
        return None

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        seqs = [self.add_request(p, params) for p in prompts]
        while self.has_work():
            self.step()
        return seqs
