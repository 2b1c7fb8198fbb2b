"""The Python API: `LLM(model=..., backend=...).generate(prompts, params)`; the CLI and server use it too."""

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from . import registry
from .engine.engine import LLMEngine
from .engine.sequence import SamplingParams, Sequence
from .errors import UserError
from .loader import LoadedModel
from .profile import Profile, env_overrides


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
    return profiles[name].overridden(**env_overrides()).overridden(**overrides)


class LLM:
    def __init__(self, model: str | LoadedModel | None = None, backend: str = "auto", precision: str | None = None,
                 profile: str | None = None, **profile_overrides):
        start = time.perf_counter()
        entries = registry.discover()
        entry = registry.select(entries, backend)
        self.loaded = model if isinstance(model, LoadedModel) else entry.backend.load_model(model)
        self.tokenizer = self.loaded.tokenizer
        settings = resolve_profile(entry.backend, profile, profile_overrides)
        self.engine = LLMEngine(entry.backend, self.loaded, precision, settings)
        self.info = LoadInfo(entry.name, self.loaded.name, time.perf_counter() - start, entries)

    @property
    def profile(self) -> Profile:
        return self.engine.profile

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if not prompt.strip():
            raise UserError("the prompt is empty: give some text")
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def generate(self, prompts: str | list[str] | list[list[int]], params: SamplingParams | None = None,
                 chat: bool = False) -> list[Completion]:
        params = params or SamplingParams()
        items = [prompts] if isinstance(prompts, str) else prompts
        seqs = [self.engine.add_request(self._ids(p, chat), params) for p in items]
        while self.engine.has_work():
            self.engine.step()
        return [self._completion(s) for s in seqs]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               chat: bool = False) -> Iterator[tuple[str, list[int]]]:
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
