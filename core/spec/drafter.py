"""What every drafter is given after a target step and returns, and what a runner that drafts on its own device
declares.

Two places draft: the engine's SpecDecoder, on the host between steps (Drafter), and a runner inside its own
device steps (DeviceDrafter: drafting, verifying and accepting chained on the device, no host round trip between
verify steps). Both follow the same rules: drafts by NgramRule, acceptance by spec.decoder.accepted_length against
the target's own samples, counters as SpecStats.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..engine.sequence import Sequence

if TYPE_CHECKING:
    from .decoder import SpecStats


@dataclass
class DraftRequest:
    """One running sequence after a target step."""

    seq: Sequence
    start: int  # first position the target computed for `seq` in the step
    count: int  # positions from `start` whose KV was kept (a prompt chunk, or the last token + accepted drafts)
    first_row: int  # row of `start` in the step's hidden states
    k: int  # drafts wanted for the next step; 0 = none (the drafter may still need to see the step)


class Drafter(Protocol):
    def propose(self, requests: list[DraftRequest], hidden: torch.Tensor | None) -> list[list[int]]:
        """Draft tokens per request (at most r.k each; fewer or none is fine). `hidden` is the target's final
        hidden states for every token of the step, [T, hidden_size], or None where the runner ran no model."""
        ...


@dataclass(frozen=True)
class NgramRule:
    """Prompt lookup: continue the latest earlier occurrence of the request's last n tokens, the longest n in
    [min_n, max_n] first (1-grams match nearly anywhere and mostly propose noise). ngram.lookup is the host's
    implementation; a device copy must propose the same drafts."""

    min_n: int = 2
    max_n: int = 4


NGRAM_RULE = NgramRule()


class DeviceDrafter(Protocol):
    """Speculative decoding a runner does inside its own steps. The engine drafts nothing for it; the runner hands
    back what plain decoding would give, sooner (its look-ahead), so the engine only keeps the runner's look-ahead
    KV slots and reads the counters here."""

    method: str  # the profile `spec` method it implements
    rule: NgramRule | None  # the n-gram rule its device code follows (None: it drafts otherwise, e.g. MTP)

    def stats(self) -> "SpecStats":
        """Its verify steps' counters, counted as the engine's SpecDecoder counts its own."""
        ...
