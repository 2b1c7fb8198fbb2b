"""What every drafter is given after a target step, and what it returns."""

from dataclasses import dataclass
from typing import Protocol

import torch

from ..engine.sequence import Sequence


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
