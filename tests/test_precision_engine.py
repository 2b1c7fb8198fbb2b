"""Every precision runs end to end through the CPU engine, with errors that grow as bits shrink."""

import pytest
import torch

from flashnext.core.engine.engine import LLMEngine
from flashnext.core.engine.scheduler import ScheduledSeq
from flashnext.core.engine.sequence import SamplingParams, Sequence
from flashnext.core.loader import load_model
from flashnext.core.profile import Profile
from flashnext.plugins.cpu import CpuBackend
from flashnext.plugins.cuda import cuda_probe

PROMPT = list(range(3, 40))


def prompt_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position, through the engine's own runner."""
    seq = Sequence(list(ids), SamplingParams())
    engine.blocks.grow(seq, len(ids))
    inputs = engine.runner.prepare([ScheduledSeq(seq, len(ids), 1)])
    hidden = engine.runner.forward(inputs)
    engine.blocks.free_sequence(seq)
    return engine.model.compute_logits(hidden)


def nmse(out, ref):
    return ((out - ref) ** 2).mean().item() / (ref**2).mean().item()


@pytest.fixture(scope="module")
def loaded(tiny_qwen3):
    return load_model(str(tiny_qwen3))


@pytest.fixture(scope="module")
def reference(loaded):
    backend = CpuBackend()
    return prompt_logits(LLMEngine(backend, loaded, "fp32", backend.profiles()["full"]), PROMPT)


@pytest.mark.parametrize(
    "precision, bound",
    [("bf16", 1e-3), ("fp16", 1e-4), ("fp8-e4m3", 3e-2), ("fp8-e5m2", 1e-1), ("int4", 2e-1)],
)
def test_precision_logits_near_fp32(loaded, reference, precision, bound):
    backend = CpuBackend()
    engine = LLMEngine(backend, loaded, precision, backend.profiles()["full"])
    logits = prompt_logits(engine, PROMPT)
    error = nmse(logits, reference)
    assert torch.isfinite(logits).all()
    assert 0 < error < bound, f"{precision}: NMSE {error:.2e}"
    out = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out.output_ids) == 8


def test_lower_precisions_really_quantize(loaded, reference):
    """int4 must differ from fp32 more than fp8, which must differ more than bf16: nobody silently computes fp32."""
    backend = CpuBackend()
    errors = {
        p: nmse(prompt_logits(LLMEngine(backend, loaded, p, backend.profiles()["full"]), PROMPT), reference)
        for p in ("bf16", "fp8-e4m3", "int4")
    }
    assert errors["bf16"] < errors["fp8-e4m3"] < errors["int4"]


def test_fp8_kv_cache_runs_and_stays_close(loaded, reference):
    backend = CpuBackend()
    profile = backend.profiles()["full"].overridden(kv_cache_dtype="fp8-e5m2")
    engine = LLMEngine(backend, loaded, "fp32", profile)
    assert engine.runner.kv_caches[0][0].dtype == torch.float8_e5m2
    assert nmse(prompt_logits(engine, PROMPT), reference) < 5e-2


class QuantizedHeadBackend(CpuBackend):
    """The CPU backend, allowed a quantized LM head (its products expand weights anyway)."""

    def quantized_head(self, precision):
        return True


def _head_engines(loaded, precision: str) -> tuple[LLMEngine, LLMEngine, Profile]:
    """Engines of `precision` weights with quantize_lm_head and without, and the profile that asks for it."""
    backend = QuantizedHeadBackend()
    asked = backend.profiles()["full"].overridden(quantize_lm_head=True)
    return (
        LLMEngine(backend, loaded, precision, asked),
        LLMEngine(backend, loaded, precision, backend.profiles()["full"]),
        asked,
    )


def test_quantize_lm_head_stores_the_head_in_the_precision_where_the_backend_can(loaded, reference):
    """profile.quantize_lm_head on a backend that can (Backend.quantized_head): the head becomes the precision's
    weight (a tied embedding table stays dense for the lookup) and the logits stay within fp8's bound of fp32. Off
    by default; a no-op for 16-bit weights; refused, naming the setting, where the backend cannot."""
    from flashnext.core.errors import UserError
    from flashnext.core.precision import PRECISIONS, Fp8Weight
    from flashnext.plugins.cuda import CudaBackend

    engine, dense, asked = _head_engines(loaded, "fp8-e4m3")
    assert isinstance(engine.model.lm_head, Fp8Weight) and isinstance(dense.model.lm_head, torch.Tensor)
    assert torch.equal(engine.model.embed, dense.model.embed)
    quantized, unquantized = prompt_logits(engine, PROMPT), prompt_logits(dense, PROMPT)
    assert nmse(quantized, unquantized) > 0 and nmse(quantized, reference) < 3e-2
    assert LLMEngine(QuantizedHeadBackend(), loaded, "bf16", asked).model.lm_head.dtype == torch.bfloat16
    with pytest.raises(UserError, match="quantize_lm_head"):
        LLMEngine(CpuBackend(), loaded, "fp8-e4m3", asked)
    fp8_cores = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    assert [CudaBackend().quantized_head(PRECISIONS[p]) for p in ("fp8-e4m3", "bf16", "int4")] == [
        True,
        False,
        fp8_cores,
    ]


def test_int4_weights_keep_a_quantized_lm_head_in_fp8(loaded):
    """Int4 weights' quantized head is fp8-e4m3 (Precision.head): the logits move by fp8's rounding of the head,
    the projections stay int4, and a backend that cannot keep it says which head it was asked for."""
    from flashnext.core.errors import UserError
    from flashnext.core.precision import PRECISIONS, Fp8Weight, Int4Weight

    engine, dense, asked = _head_engines(loaded, "int4")
    assert PRECISIONS["int4"].head.name == "fp8-e4m3" and PRECISIONS["fp8-e4m3"].head.name == "fp8-e4m3"
    assert isinstance(engine.model.lm_head, Fp8Weight) and isinstance(engine.model.layers[0].qkv, Int4Weight)
    fp8_head_error = nmse(prompt_logits(engine, PROMPT), prompt_logits(dense, PROMPT))
    assert 0 < fp8_head_error < 1e-2
    with pytest.raises(UserError, match="LM head of int4 weights in fp8-e4m3"):
        LLMEngine(CpuBackend(), loaded, "int4", asked)


@pytest.mark.parametrize(
    "capability,stored,expected",
    [
        ((9, 0), "fp8-e4m3", "fp8-e4m3"),
        ((8, 9), "fp8-e4m3", "fp8-e4m3"),
        ((8, 6), "fp8-e4m3", "bf16"),
        ((9, 0), "fp8-e5m2", "bf16"),
        ((9, 0), "bf16", "bf16"),
    ],
)
def test_cuda_runs_an_fp8_checkpoint_in_fp8_where_the_gpu_has_fp8_tensor_cores(
    monkeypatch, capability, stored, expected
):
    """An e4m3 checkpoint keeps its bytes (half bf16's memory) on Ada / Hopper and later; older GPUs, whose
    fp8-e4m3 request is refused naming the GPU, run it as bf16 values."""
    import flashnext.plugins.cuda as cuda_plugin
    from flashnext.core.errors import UserError
    from flashnext.core.precision import PRECISIONS

    monkeypatch.setattr(cuda_plugin, "_capability", lambda: (*capability, "Test GPU"))
    weight = PRECISIONS[stored].quantize(torch.randn(32, 64))
    backend = cuda_plugin.CudaBackend()
    assert backend.preferred_precision({"model.layers.0.mlp.down_proj.weight": weight}) == expected
    if capability < (8, 9):
        with pytest.raises(UserError, match=r"Test GPU is 8\.6: use --precision bf16"):
            backend.check_request("fp8-e4m3", backend.profiles()["basic"])


def test_cuda_probe_gives_a_reason():
    probe = cuda_probe()
    if torch.cuda.is_available():
        assert probe.available and probe.facts["compute_capability"]
    else:
        assert not probe.available and probe.score == 0 and "CUDA" in probe.reason
