"""Fault: the model runner's logits are NaN (an overflow in a fused LM head), while every kernel alone is right."""

import torch

from flashnext.core.engine.runner import ModelRunner, StepResult
from flashnext.core.hookspecs import hookimpl
from flashnext.plugins.cpu import CpuBackend


class NanLogitsRunner(ModelRunner):
    def step(self, inputs):
        result = super().step(inputs)
        return StepResult(result.sampled, torch.full_like(result.logits, float("nan")), result.hidden)


class BrokenNanlogitsBackend(CpuBackend):
    name = "broken-nanlogits"

    def runner_class(self, profile):
        return NanLogitsRunner


@hookimpl
def register_backends(register):
    register(BrokenNanlogitsBackend())
