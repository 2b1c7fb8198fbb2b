"""Fault: the model runner's logits are NaN (an overflow in a fused LM head), while every kernel alone is right."""

import torch

from flashnext.core.engine.runner import ModelRunner
from flashnext.core.hookspecs import hookimpl
from flashnext.plugins.cpu import CpuBackend


class NanLogitsRunner(ModelRunner):
    def run(self, batch):
        logits, sampled = super().run(batch)
        return torch.full_like(logits, float("nan")), sampled


class BrokenNanlogitsBackend(CpuBackend):
    name = "broken-nanlogits"

    def runner_class(self, profile):
        return NanLogitsRunner


@hookimpl
def register_backends(register):
    register(BrokenNanlogitsBackend())
