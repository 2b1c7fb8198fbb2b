"""Prompt-lookup drafting: continue the latest earlier occurrence of the request's last n tokens."""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .drafter import DraftRequest

# Longest suffix tried first; 1-grams match nearly anywhere and mostly propose noise.
MIN_NGRAM, MAX_NGRAM = 2, 4


def lookup(tokens: list[int], k: int, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest matching suffix (n in [min_n, max_n])."""
    arr = np.asarray(tokens, dtype=np.int64)
    size = len(arr)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # Windows start before the suffix itself, so every hit has at least one following token.
        windows = sliding_window_view(arr[: size - 1], n)
        hits = np.flatnonzero((windows == arr[size - n :]).all(axis=1))
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
