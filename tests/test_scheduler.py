"""Scheduler: decodes first, the token budget, chunk sizes, preemption of the newest, nothing dropped, max_num_seqs.

No model runs here: `step` does the engine's bookkeeping (advance, append a token, publish blocks, finish) with a
fake sampled token, so every scheduling decision can be checked exactly.
"""

import random

from flashnext.core.engine.block_manager import BlockManager
from flashnext.core.engine.scheduler import Scheduler
from flashnext.core.engine.sequence import SamplingParams, Sequence, Status

BS = 4


def make(num_blocks=64, max_num_seqs=8, budget=16) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_num_seqs, budget)


def request(n_prompt: int, max_tokens: int = 4, chunked: bool = True, first: int = 0) -> Sequence:
    prompt = list(range(first, first + n_prompt))
    return Sequence(prompt, SamplingParams(max_tokens=max_tokens), chunked_prefill=chunked)


def step(sched: Scheduler):
    """One engine step without a model; returns [(seq, num_tokens, num_logits)]."""
    batch = sched.schedule()
    for item in batch:
        seq = item.seq
        assert len(seq.block_table) * BS >= seq.num_computed + item.num_tokens  # every token has a slot
        seq.num_computed += item.num_tokens
        if item.num_logits:
            seq.token_ids.append(1000 + len(seq.output_ids))  # fake sample: deterministic per position
        sched.blocks.commit_full_blocks(seq)
        if len(seq.output_ids) >= seq.params.max_tokens:
            sched.finish(seq, "length")
    return [(item.seq, item.num_tokens, item.num_logits) for item in batch]


def run_all(sched: Scheduler, max_steps=10_000):
    steps = []
    while sched.has_work():
        steps.append(step(sched))
        assert len(steps) < max_steps, "the scheduler stopped making progress"
    return steps


def test_long_prompt_is_chunked_with_a_ragged_last_chunk():
    sched = make(budget=16)
    seq = request(50, max_tokens=3)
    sched.add(seq)
    steps = run_all(sched)
    assert [s[0][1:] for s in steps] == [(16, 0), (16, 0), (16, 0), (2, 1), (1, 1), (1, 1)]
    assert sched.prefill_chunks == 4
    assert seq.output_ids == [1000, 1001, 1002]


def test_unchunked_prompt_runs_whole_even_past_the_budget():
    sched = make(budget=16)
    sched.add(request(50, chunked=False))
    assert [(n, k) for _, n, k in step(sched)] == [(50, 1)]
    assert sched.prefill_chunks == 0


def test_running_decodes_come_first_and_prefill_gets_the_rest_of_the_budget():
    sched = make(budget=16)
    early = [request(3, max_tokens=100, first=100 * i) for i in range(3)]
    for seq in early:
        sched.add(seq)
    step(sched)  # the three short prompts fit in one step
    long = request(40, max_tokens=2, first=900)
    sched.add(long)
    batch = step(sched)
    assert [(s, n, k) for s, n, k in batch[:3]] == [(seq, 1, 1) for seq in early]
    assert batch[3] == (long, 13, 0)  # 16 - 3 decodes
    batch = step(sched)
    assert [n for _, n, _ in batch] == [1, 1, 1, 13]


def test_budget_is_never_exceeded_with_chunking():
    rng = random.Random(0)
    sched = make(num_blocks=200, max_num_seqs=6, budget=24)
    seqs = [request(rng.randint(1, 60), max_tokens=rng.randint(1, 12), first=rng.randint(0, 10_000)) for _ in range(30)]
    for seq in seqs[:10]:
        sched.add(seq)
    steps = []
    while sched.has_work():
        if len(steps) % 3 == 0 and len(steps) // 3 + 10 < len(seqs):
            sched.add(seqs[len(steps) // 3 + 10])
        batch = step(sched)
        steps.append(batch)
        assert sum(n for _, n, _ in batch) <= 24
        assert len(sched.running) <= 6
        assert len(batch) <= 6
        assert len({id(s) for s, _, _ in batch}) == len(batch)  # a sequence appears once per step
    assert all(s.finish_reason == "length" and len(s.output_ids) == s.params.max_tokens for s in seqs)
    assert sched.blocks.num_free == 200


def test_max_num_seqs_caps_the_running_set():
    sched = make(max_num_seqs=2, budget=64)
    seqs = [request(4, max_tokens=3, first=10 * i) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    batch = step(sched)
    assert [s for s, _, _ in batch] == seqs[:2]
    assert len(sched.waiting) == 3
    run_all(sched)
    assert all(len(s.output_ids) == 3 for s in seqs)


def test_waiting_queue_is_first_come_first_served():
    sched = make(num_blocks=64, max_num_seqs=1, budget=64)
    seqs = [request(4, max_tokens=2, first=10 * i) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    order = []
    for batch in run_all(sched):
        for seq, _, _ in batch:
            if seq not in order:
                order.append(seq)
    assert order == seqs


def test_out_of_blocks_preempts_the_newest_and_requeues_it_first():
    sched = make(num_blocks=4, budget=64)
    old, new = request(7, max_tokens=20), request(7, max_tokens=20, first=50)
    sched.add(old)
    sched.add(new)
    step(sched)  # each holds 2 blocks (7 tokens), all 4 blocks used
    step(sched)  # 8 tokens each: still 2 blocks each
    assert sched.blocks.num_free == 0 and sched.preemptions == 0
    batch = step(sched)  # old needs a 3rd block: new goes
    assert sched.preemptions == 1
    assert [s for s, _, _ in batch] == [old]
    assert new.status is Status.WAITING and new.block_table == [] and new.num_computed == 0
    assert sched.waiting[0] is new
    assert len(new.output_ids) == 2  # generated tokens are kept and recomputed, not lost


def test_a_sequence_that_is_itself_the_newest_preempts_itself():
    sched = make(num_blocks=4, budget=64)
    old, new = request(5, max_tokens=8), request(8, max_tokens=6, first=50)  # each fits the 16 slots alone
    sched.add(old)
    sched.add(new)
    step(sched)  # 2 blocks each; old has room up to 8 tokens, new is at its 9th
    batch = step(sched)
    assert [(s, n) for s, n, _ in batch] == [(old, 1)]
    assert sched.preemptions == 1 and new.status is Status.WAITING and old.status is Status.RUNNING
    run_all(sched)
    assert (len(old.output_ids), len(new.output_ids)) == (8, 6)


def test_preempted_requests_all_complete_under_a_tiny_cache():
    rng = random.Random(1)
    sched = make(num_blocks=12, max_num_seqs=8, budget=32)
    seqs = [request(rng.randint(4, 20), max_tokens=rng.randint(8, 24), first=1000 * i) for i in range(12)]
    for seq in seqs:
        sched.add(seq)
    run_all(sched)
    assert sched.preemptions > 0
    assert all(s.status is Status.FINISHED and len(s.output_ids) == s.params.max_tokens for s in seqs)
    # Fake samples depend only on the position: recomputation after preemption changed nothing.
    assert all(s.output_ids == [1000 + i for i in range(s.params.max_tokens)] for s in seqs)
    assert sched.blocks.num_free == 12 and set(sched.blocks.ref_counts) == {0}


def test_preemption_skips_victims_later_in_the_same_step():
    sched = make(num_blocks=6, budget=64)
    seqs = [request(8, max_tokens=30, first=100 * i) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    step(sched)  # 3 x 2 blocks: full; each is at its 9th token
    batch = step(sched)  # the oldest needs a block: the newest goes, its two blocks serve the two older ones
    assert [(s, n) for s, n, _ in batch] == [(seqs[0], 1), (seqs[1], 1)]
    assert sched.preemptions == 1 and seqs[2].status is Status.WAITING and sched.waiting[0] is seqs[2]


def test_finish_frees_blocks_of_running_and_waiting_requests():
    sched = make(num_blocks=16, max_num_seqs=1)
    a, b = request(10), request(10, first=50)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert a.status is Status.RUNNING and b.status is Status.WAITING
    sched.finish(b, "abort")
    sched.finish(a, "abort")
    assert not sched.has_work() and sched.blocks.num_free == 16
    assert a.finish_reason == b.finish_reason == "abort"


def test_prefix_hit_skips_the_cached_blocks():
    sched = make(num_blocks=32, budget=64)
    first = request(18, max_tokens=1)
    sched.add(first)
    run_all(sched)
    again = request(18, max_tokens=1)
    sched.add(again)
    assert step(sched)[0][1:] == (2, 1)  # 16 cached tokens, 2 computed
    assert sched.blocks.prefix_hits == 4
