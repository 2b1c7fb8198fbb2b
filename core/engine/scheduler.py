"""Continuous batching: running sequences first, then new prompts, within a per-step token budget."""

from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # query tokens computed this step (drafts included)
    num_logits: int  # trailing query positions whose logits are needed (0 for a non-final prefill chunk)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the newest is preempted first
        self.preemptions = 0
        self.prefill_chunks = 0  # prompt pieces scheduled while the prompt was not yet whole

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = self._tokens_for(seq, budget, batch_empty=not batch)
            if n == 0:
                continue
            if not self._make_room(seq, seq.num_computed + n):
                continue
            batch.append(self._scheduled(seq, n))
            budget -= n
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            if not self._admit(self.waiting[0], budget, batch):
                break
            seq = self.waiting.popleft()
            budget -= batch[-1].num_tokens
        return batch

    def _tokens_for(self, seq: Sequence, budget: int, batch_empty: bool) -> int:
        if seq.num_uncomputed + len(seq.draft_ids) > budget:  # drafts are optional: shed them, not the decode
            del seq.draft_ids[max(0, budget - seq.num_uncomputed) :]
        wanted = seq.num_uncomputed + len(seq.draft_ids)
        if wanted <= budget:
            return wanted
        if seq.in_prefill and seq.chunked_prefill:
            return budget
        # An unchunked prompt larger than the budget runs alone rather than never.
        return wanted if batch_empty else 0

    def _admit(self, seq: Sequence, budget: int, batch: list[ScheduledSeq]) -> bool:
        if not self.blocks.admit(seq):
            return False
        n = self._tokens_for(seq, budget, batch_empty=not batch)
        if n == 0 or not self.blocks.can_grow(seq, seq.num_computed + n):
            self.blocks.free_sequence(seq)
            seq.num_computed = 0
            return False
        self.blocks.grow(seq, seq.num_computed + n)
        self.blocks.count_prefix_lookup(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        batch.append(self._scheduled(seq, n))
        return True

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Preempt the newest other sequences until `seq` fits; preempt `seq` itself if it is the newest."""
        if not self.blocks.blocks_needed(seq, num_tokens):  # a decode step within its blocks: the common case
            return True
        while not self.blocks.can_grow(seq, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.blocks.grow(seq, num_tokens)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free a sequence's blocks and queue it first for recomputation: never dropped."""
        self.running.remove(seq)
        self.blocks.free_sequence(seq)
        seq.num_computed, seq.status, seq.draft_ids = 0, Status.WAITING, []
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledSeq:
        completes = seq.num_computed + n == len(seq) + len(seq.draft_ids)
        if seq.in_prefill and (not completes or seq.num_computed > seq.num_cached_prefix):
            self.prefill_chunks += 1
        return ScheduledSeq(seq, n, (1 + len(seq.draft_ids)) if completes else 0)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_sequence(seq)
