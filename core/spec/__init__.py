"""Speculative decoding: drafters propose tokens, the target verifies them in one forward pass.

`decoder.SpecDecoder` is what the engine talks to; `ngram` and `mtp` are the drafters; `adaptive` decides per request
whether and how much to draft.
"""
