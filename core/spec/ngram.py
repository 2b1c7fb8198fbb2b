"""Prompt-lookup drafting: continue the latest earlier occurrence of the request's last n tokens."""

import numpy as np

from .drafter import NGRAM_RULE, DraftRequest

MIN_NGRAM, MAX_NGRAM = NGRAM_RULE.min_n, NGRAM_RULE.max_n


def lookup(tokens: list[int], k: int, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest matching suffix (n in [min_n, max_n])."""
    arr = np.asarray(tokens, dtype=np.int64)
    size = len(arr)
    # Every hit ends on an earlier copy of the last token (before the suffix itself, so it has a following
    # token): n-grams are compared there only, one token at a time. A per-step cost of a few microseconds,
    # which free-form decoding (mostly no hit) pays on every token.
    ends = np.flatnonzero(arr[: size - 1] == arr[-1])
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        fits = ends[ends >= n - 1]
        match = np.ones(fits.size, dtype=bool)
        for back in range(1, n):
            match &= arr[fits - back] == arr[size - 1 - back]
        hits = fits[match] - (n - 1)
        if hits.size:
            # The most recent hit is the best guess, unless only an older one has k tokens to copy.
            whole = hits[hits + n + k <= size]
            start = (whole[-1] if whole.size else hits[0]) + n
            return arr[start : start + k].tolist()
    return []


class NgramDrafter:
    """No weights, no device work: drafts come from the request's own prompt and output."""

    def propose(self, requests: list[DraftRequest], hidden) -> list[list[int]]:
        return [lookup(r.seq.token_ids, r.k) if r.k else [] for r in requests]
