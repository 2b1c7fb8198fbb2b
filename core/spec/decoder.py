"""The engine's side of speculative decoding: verify drafts against the target's samples, then draft again.

Verification is exact rejection sampling with a point-mass proposal. The runner samples every verified row with
the target's own sampler, whose noise is keyed by (request seed, position): row i is the token plain decoding
would draw at that position given the drafts before it. Draft i is accepted iff it equals that sample, which
happens with probability p(draft) (greedy: iff it is the argmax); at the first mismatch the sample itself is
taken, distributed as p restricted to tokens other than the draft, i.e. norm(max(p - q, 0)) for q a point mass.
So the output has the target's distribution, and is token-for-token what `--spec none` gives for the same seed.
"""

from dataclasses import dataclass, field

import torch

from ..engine.block_manager import BlockManager
from ..engine.scheduler import ScheduledSeq
from ..engine.sequence import Sequence, Status
from ..profile import Profile
from .adaptive import AcceptanceTracker
from .drafter import DeviceDrafter, Drafter, DraftRequest
from .mtp import MtpDrafter, MtpModule
from .ngram import NgramDrafter


@dataclass
class SpecStats:
    drafts: int = 0  # verify steps that carried at least one draft token
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.drafted += drafted
        self.accepted += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def as_dict(self) -> dict:
        return {
            "drafts": self.drafts,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "accepted_per_position": list(self.accepted_per_position),
            # Tokens a verify step yields on average: accepted drafts plus the target's own token.
            "mean_acceptance_length": round(1 + self.accepted / self.drafts, 4) if self.drafts else 0.0,
        }


def accepted_length(drafts: list[int], sampled: list[int]) -> int:
    """Leading drafts equal to the target's samples at their positions."""
    n = 0
    while n < len(drafts) and drafts[n] == sampled[n]:
        n += 1
    return n


class SpecDecoder:
    def __init__(
        self,
        profile: Profile,
        mtp: MtpModule | None,
        blocks: BlockManager,
        kv_dtype: torch.dtype,
        max_model_len: int,
        device_drafter: DeviceDrafter | None = None,
    ):
        self.profile, self.blocks, self.max_model_len = profile, blocks, max_model_len
        # A runner that drafts on its device gets no drafts: it fills the engine's look-ahead slots.
        self.device_drafter = device_drafter
        self.drafter: Drafter | None = None
        if device_drafter is None:
            self.drafter = MtpDrafter(mtp, blocks.num_blocks, blocks.block_size, kv_dtype) if mtp else NgramDrafter()
        self.stats = SpecStats()

    def counters(self) -> SpecStats:
        """The counters of whoever drafts: the runner's device drafter, else this decoder's own."""
        return self.device_drafter.stats() if self.device_drafter else self.stats

    def tracker(self, seq: Sequence) -> AcceptanceTracker:
        if seq.spec_tracker is None:
            p = self.profile
            seq.spec_tracker = AcceptanceTracker(k=p.spec_tokens, k_max=p.spec_tokens, adaptive=p.spec_adaptive)
        return seq.spec_tracker

    def accept(self, seq: Sequence, drafts: list[int], sampled: list[int]) -> list[int]:
        """The tokens a verify step yields: accepted drafts, then the target's token at the first miss (or bonus)."""
        n = accepted_length(drafts, sampled)
        self.stats.record(len(drafts), n)
        self.tracker(seq).record(len(drafts), n)
        return drafts[:n] + [sampled[n]]

    def after_step(self, batch: list[ScheduledSeq], starts: list[int], hidden: torch.Tensor | None) -> None:
        """Draft for the next step. `starts`: each sequence's num_computed before the step; `hidden`: the
        target's final hidden states for every token of the step."""
        requests, row = [], 0
        if len(batch) > self.profile.spec_max_batch or self.device_drafter:
            return
        for item, start in zip(batch, starts):
            seq, first_row = item.seq, row
            row += item.num_tokens
            if seq.status is not Status.RUNNING or not seq.spec_enabled:
                continue
            k = self._drafts_wanted(seq) if seq.num_uncomputed == 1 else 0  # drafts only once the prompt is in
            requests.append(DraftRequest(seq, start, seq.num_computed - start, first_row, k))
        if requests:
            self._propose(requests, hidden)

    def _drafts_wanted(self, seq: Sequence) -> int:
        k = self.tracker(seq).drafts_wanted()
        # A verify step adds up to k + 1 tokens: stay within max_tokens and the context.
        k = min(k, seq.tokens_left - 1, self.max_model_len - len(seq) - 1)
        # The verify step's slots come from free blocks, taken now: drafts never preempt anyone to make room.
        if k <= 0 or not self.blocks.can_grow(seq, len(seq) + k):
            return 0
        self.blocks.grow(seq, len(seq) + k)
        return k

    def _propose(self, requests: list[DraftRequest], hidden: torch.Tensor | None) -> None:
        for r, drafts in zip(requests, self.drafter.propose(requests, hidden)):
            if r.k:
                r.seq.draft_ids = drafts
                self.blocks.truncate(r.seq, len(r.seq) + len(drafts))  # give back slots a short draft left unused
