"""The Python API: `LLM(model=..., backend=...).generate(prompts, params)`; the CLI and server use it too."""

import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from . import parallel, progress, registry
from .engine.engine import LLMEngine
from .engine.sequence import SamplingParams, Sequence
from .errors import EMPTY_PROMPT, UserError
from .loader import LoadedModel
from .profile import Profile, env_overrides
from .threads import ThreadChoice, apply_threads, choose_threads

WARM_UP_PROMPT = 4  # tokens: a prefill and then a decode step, each shape the first real request runs


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None


@dataclass
class LoadInfo:
    backend: str
    model: str
    load_s: float
    entries: list = field(default_factory=list)  # every probed backend, for --explain


def resolve_profile(backend, name: str | None, overrides: dict) -> Profile:
    """Backend profile < FLASHNEXT_* env < explicit overrides (flags)."""
    profiles = backend.profiles()
    name = name or backend.default_profile
    if name not in profiles:
        raise UserError(f"backend '{backend.name}' has no profile '{name}': choose one of {', '.join(profiles)}")
    return profiles[name].overridden(**env_overrides(profile_class=type(profiles[name]))).overridden(**overrides)


def per_rank(choice: ThreadChoice, ranks: int) -> ThreadChoice:
    """Ranks on one machine share its cores: the automatic choice is divided among them."""
    if ranks == 1:
        return choice
    threads = max(1, choice.threads // ranks)
    return ThreadChoice(threads, f"{choice.reason}; divided among {ranks} tensor-parallel ranks")


def within_context(loaded: LoadedModel, max_model_len: int | None) -> LoadedModel:
    """The model with its context length cut to --max-model-len, so tables sized by it (rope) stay that small."""
    if max_model_len is None or max_model_len >= loaded.config.max_position_embeddings:
        return loaded
    config = loaded.config.model_copy(update={"max_position_embeddings": max_model_len})
    return dataclasses.replace(loaded, config=config)


class LLM:
    def __init__(
        self,
        model: str | LoadedModel | None = None,
        backend: str = "auto",
        precision: str | None = None,
        profile: str | None = None,
        **profile_overrides,
    ):
        start = time.perf_counter()
        entries = registry.discover()
        entry = registry.select(entries, backend)
        settings = resolve_profile(entry.backend, profile, profile_overrides)
        self.threads: ThreadChoice = choose_threads(settings.threads)
        if settings.threads is None:
            self.threads = per_rank(self.threads, int(os.environ.get("LOCAL_WORLD_SIZE", settings.tensor_parallel)))
        apply_threads(self.threads)
        if precision is not None:  # a precision the backend refuses is refused before minutes of loading
            entry.backend.check_request(precision, settings)
        call = dict(profile_overrides, model=model, backend=entry.name, precision=precision, profile=profile)
        self.parallel = parallel.start(entry.backend, model, settings, call | {"threads": self.threads.threads})
        if self.parallel:
            if not self.parallel.leader:
                progress.silence()  # rank 0 reports for the group
            with progress.stage(f"loading model (rank 0 of {self.parallel.size}: its shard)") as advance:
                self.loaded = parallel.load_shard(self.parallel, model)
                advance(self.loaded.name)
        else:
            self.loaded = model if isinstance(model, LoadedModel) else self._load(entry.backend, model)
        self.tokenizer = self.loaded.tokenizer
        self.loaded = within_context(self.loaded, settings.max_model_len)
        with progress.stage(f"preparing weights for {entry.name}") as advance:
            self.engine = LLMEngine(entry.backend, self.loaded, precision, settings, self.parallel)
            advance(self.engine.precision.name)
        # The engine's model holds what it runs on; the loader's own tensors (q, k, v and gate, up before they were
        # merged) would stay resident beside their merged copies: about 50 MiB on the default model.
        self.loaded = dataclasses.replace(self.loaded, weights={})
        if self.parallel and not self.parallel.leader:
            self.parallel.follow(self.engine)
            raise SystemExit(0)  # rank 0 ended the run: this rank's process has served its purpose
        self.info = LoadInfo(entry.name, self.loaded.name, time.perf_counter() - start, entries)
        self._warm_up_s = 0.0

    def warm_up(self) -> float:
        """The one-time work of the first steps (weight expansion, kernel compiles, graph captures), done now on a
        throwaway request of a few tokens rather than inside the first real one; returns its seconds."""
        start, runner_before = time.perf_counter(), self.engine.runner.stats().warm_up_s
        with progress.stage("warming up") as advance:
            prompt = [i % self.engine.config.vocab_size for i in range(1, WARM_UP_PROMPT + 1)]
            seq = self.engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True), spec_enabled=False)
            while seq.finish_reason is None:
                self.engine.step()
            seconds = time.perf_counter() - start
            advance(f"{seconds:.1f} s of one-time work")
        self._warm_up_s += seconds - (self.engine.runner.stats().warm_up_s - runner_before)  # the runner counts its own
        return seconds

    def close(self) -> None:
        """End the tensor-parallel group (its other ranks exit; this process may start another). Done at exit
        anyway; nothing to do on one device."""
        if self.parallel:
            self.parallel.stop()

    @staticmethod
    def _load(backend, model: str | None) -> LoadedModel:
        with progress.stage("loading model") as advance:
            loaded = backend.load_model(model)
            advance(loaded.name)
        return loaded

    @property
    def warm_up_s(self) -> float:
        """Seconds of one-time work so far: the warm-up's, and what the runner counted inside steps."""
        return self._warm_up_s + self.engine.runner.stats().warm_up_s

    @property
    def profile(self) -> Profile:
        return self.engine.profile

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if not prompt.strip():
            raise UserError(EMPTY_PROMPT)
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def generate(
        self, prompts: str | list[str] | list[list[int]], params: SamplingParams | None = None, chat: bool = False
    ) -> list[Completion]:
        params = params or SamplingParams()
        items = [prompts] if isinstance(prompts, str) else prompts
        seqs = [self.engine.add_request(self._ids(p, chat), params) for p in items]
        while self.engine.has_work():
            self.engine.step()
        return [self._completion(s) for s in seqs]

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None, chat: bool = False
    ) -> Iterator[tuple[str, list[int]]]:
        """Yields (new text, new token ids) as tokens come; the last item may carry text only."""
        seq = self.engine.add_request(self._ids(prompt, chat), params or SamplingParams())
        decoder = self.tokenizer.stream()
        try:
            while seq.finish_reason is None:
                for out in self.engine.step():
                    if out.seq is seq and out.new_token_ids:
                        yield "".join(decoder.push(t) for t in out.new_token_ids), out.new_token_ids
            yield decoder.flush(), []
        finally:
            self.engine.abort(seq)
        self.last = seq

    def _ids(self, prompt, chat: bool) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else self.encode(prompt, chat)

    def _completion(self, seq: Sequence) -> Completion:
        return Completion(self.tokenizer.decode(seq.output_ids), seq.output_ids, seq.prompt_ids, seq.finish_reason)
