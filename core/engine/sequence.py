"""A request's tokens and progress through the engine."""

import enum
import itertools
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from ..spec.adaptive import AcceptanceTracker


class SamplingParams(BaseModel):
    """How to pick the next token and when to stop. Temperature 0 means greedy."""

    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # Upper bounds keep every value inside the int64 tensors the samplers take (a larger top_k means "no limit").
    top_k: int = Field(default=0, ge=0, le=2**31 - 1)
    max_tokens: int = Field(default=256, ge=1, le=2**31 - 1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)

    def stop_ids(self, eos_ids) -> list[int]:
        """The tokens that end the request: the model's EOS tokens, then its own stop_token_ids; none with
        ignore_eos. The engine stops at them, and a runner that runs steps ahead may stop there too."""
        if self.ignore_eos:
            return []
        return [*eos_ids, *dict.fromkeys(t for t in self.stop_token_ids if t not in eos_ids)]

    def stops_at(self, token: int, eos_ids) -> bool:
        """token in stop_ids(eos_ids), without building the list: the engine asks for every generated token."""
        return not self.ignore_eos and (token in eos_ids or token in self.stop_token_ids)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    chunked_prefill: bool = True  # a per-request profile may turn chunking off for its prompt
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    num_cached_prefix: int = 0  # tokens served by the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival_index: int = field(default_factory=lambda: next(_ids))
    seed: int = 0
    # Speculative decoding: tokens proposed for the next step, verified by the target model.
    draft_ids: list[int] = field(default_factory=list)
    spec_enabled: bool = True  # a per-request profile (basic) turns drafting off for this request
    spec_tracker: "AcceptanceTracker | None" = None  # rolling acceptance, made on the first draft

    def __post_init__(self):
        self.token_ids = list(self.prompt_ids)
        self.request_id = self.request_id or f"req-{self.arrival_index}"
        self.seed = self.params.seed if self.params.seed is not None else random.getrandbits(62)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def tokens_left(self) -> int:
        """Output tokens max_tokens still allows."""
        return self.params.max_tokens - (len(self.token_ids) - self.num_prompt)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def query_tokens(self, start: int, n: int) -> list[int]:
        """Tokens start..start+n of the sequence followed by its drafts; copies only the uncomputed tail."""
        return (self.token_ids[start:] + self.draft_ids)[:n]

    @property
    def in_prefill(self) -> bool:
        return self.num_uncomputed > 1
