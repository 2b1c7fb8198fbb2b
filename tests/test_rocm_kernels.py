"""The rocm backend's kernels: the CUDA plugin's Triton kernels with ROCm flash attention for prefill and FP8 in
the weights' own format mixed in. Here through Triton's interpreter on the CPU; on an NVIDIA GPU compiled (the
shared kernels have run on NVIDIA GPUs only). flash_attn is the fake of rocm_fakes."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit of the shared kernels
pytest.importorskip("triton", reason="triton is a test dependency (pip install triton)")

from flashnext.core.kernels import AttentionMetadata  # noqa: E402
from flashnext.core.precision import PRECISIONS  # noqa: E402
from flashnext.plugins.cuda import CudaBackend  # noqa: E402
from flashnext.plugins.rocm import RocmBackend, attention  # noqa: E402
from rocm_fakes import fake_flash_attn, no_amdsmi, path_with_only, rocm_torch  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 64, 16


def rocm_kernels(monkeypatch, tmp_path, with_flash: bool, precision: str = "bf16"):
    """RocmBackend.kernels as an MI300X with (or without) flash_attn gets them; the patches end before they run."""
    calls = None
    with monkeypatch.context() as m:
        rocm_torch(m, "mi300x")
        no_amdsmi(m)
        path_with_only(m, tmp_path)
        if with_flash:
            calls = fake_flash_attn(m)
        else:
            m.setitem(sys.modules, "flash_attn", None)
            attention.load_flash_attn.cache_clear()
        kernels = RocmBackend().kernels(PRECISIONS[precision])
    attention.load_flash_attn.cache_clear()
    return kernels, calls


def step(query_lens, context_lens, seed=0):
    """qkv rows, positions, scattered paged caches (prefixes already filled) and metadata for one step."""
    torch.manual_seed(seed)
    blocks = [-(-c // BLOCK) for c in context_lens]
    order = torch.randperm(sum(blocks)).tolist()
    tables, start = [], 0
    for n in blocks:
        tables.append(order[start : start + n])
        start += n
    positions = [p for q, c in zip(query_lens, context_lens) for p in range(c - q, c)]
    slots = [
        t[p // BLOCK] * BLOCK + p % BLOCK for t, q, c in zip(tables, query_lens, context_lens) for p in range(c - q, c)
    ]
    meta = AttentionMetadata.from_host(slots, list(query_lens), list(context_lens), tables, DEV)
    k_cache = torch.randn(len(order), BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16, device=DEV)
    v_cache = torch.randn_like(k_cache)
    qkv = torch.randn(len(positions), (HEADS + 2 * KV_HEADS) * DIM, dtype=torch.bfloat16, device=DEV)
    angles = torch.outer(torch.arange(float(max(context_lens))), 1.0 / 10000 ** (torch.arange(0, DIM, 2) / DIM))
    cos_sin = torch.cat((angles.cos(), angles.sin()), -1).to(DEV)
    return qkv, torch.tensor(positions, device=DEV), cos_sin, k_cache, v_cache, meta


def rope_attention(kernels, qkv, positions, cos_sin, k_cache, v_cache, meta):
    k, v = k_cache.clone(), v_cache.clone()
    out = kernels.rope_attention(qkv, None, None, 1e-6, positions, cos_sin, k, v, meta, DIM**-0.5, HEADS, KV_HEADS, DIM)
    return out, k, v


def test_kernels_are_the_shared_ones_with_flash_prefill_and_own_format_fp8(monkeypatch, tmp_path):
    kernels, _ = rocm_kernels(monkeypatch, tmp_path, with_flash=True)
    shared = type(CudaBackend().kernels(PRECISIONS["bf16"]))
    assert isinstance(kernels, shared) and kernels.flash_attn_varlen_func is not None
    assert [c.__name__ for c in type(kernels).__mro__[1:4]] == ["FlashAttnPrefill", "OwnFormatFp8", "NoInt4Gemv"]
    assert type(kernels) is type(rocm_kernels(monkeypatch, tmp_path, with_flash=False)[0])  # one class, not one a call
    without, _ = rocm_kernels(monkeypatch, tmp_path, with_flash=False)
    assert without.flash_attn_varlen_func is None


def test_prefill_through_flash_attn_matches_the_triton_paged_kernel(monkeypatch, tmp_path):
    kernels, calls = rocm_kernels(monkeypatch, tmp_path, with_flash=True)
    triton_only, _ = rocm_kernels(monkeypatch, tmp_path, with_flash=False)
    # a whole prompt and a chunk after a 20-token prefix, in one step
    inputs = step([7, 5], [7, 25])
    flash_out, flash_k, flash_v = rope_attention(kernels, *inputs)
    paged_out, paged_k, paged_v = rope_attention(triton_only, *inputs)
    assert len(calls) == 1 and calls[0]["cu_seqlens_k"].tolist() == [0, 7, 32] and calls[0]["causal"] is True
    assert torch.equal(flash_k, paged_k) and torch.equal(flash_v, paged_v)  # the KV write is the shared kernel's
    torch.testing.assert_close(flash_out.float(), paged_out.float(), atol=2e-2, rtol=2e-2)


def test_decode_stays_on_the_triton_kernel(monkeypatch, tmp_path):
    kernels, calls = rocm_kernels(monkeypatch, tmp_path, with_flash=True)
    triton_only, _ = rocm_kernels(monkeypatch, tmp_path, with_flash=False)
    inputs = step([1, 1, 1], [9, 17, 33], seed=1)
    assert torch.equal(rope_attention(kernels, *inputs)[0], rope_attention(triton_only, *inputs)[0])
    assert calls == []


def test_fnuz_fp8_projection_past_the_gemv_rows_meets_fnuz_activations(monkeypatch, tmp_path):
    kernels, _ = rocm_kernels(monkeypatch, tmp_path, with_flash=False, precision="fp8-e4m3")
    seen = []

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        seen.append((a.dtype, b.dtype))
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    torch.manual_seed(3)
    w = PRECISIONS["fp8-e4m3"].stored_as(torch.float8_e4m3fnuz).quantize(torch.randn(64, 128, device=DEV))
    x = torch.randn(80, 128, dtype=torch.bfloat16, device=DEV)
    out = kernels.linear(x, w)
    assert seen == [(torch.float8_e4m3fnuz, torch.float8_e4m3fnuz)]
    reference = x.float() @ w.dequantize().t()
    assert ((out.float() - reference).norm() / reference.norm()) < 0.06
    assert not kernels._takes_fp8_rows(x, w)


@pytest.mark.parametrize("rows", [1, 4, 24])
def test_int4_never_takes_the_ptx_gemv_and_matches_the_shared_kernels(monkeypatch, tmp_path, rows):
    kernels, _ = rocm_kernels(monkeypatch, tmp_path, with_flash=False, precision="int4")
    shared = type(CudaBackend().kernels(PRECISIONS["int4"]))()
    torch.manual_seed(4)
    w = PRECISIONS["int4"].quantize(torch.randn(96, 256, device=DEV))
    x = torch.randn(rows, 256, dtype=torch.bfloat16, device=DEV)
    assert not kernels._gemv_route(x, w) and (rows > 4 or shared._gemv_route(x, w))
    dense = torch.randn(96, 256, dtype=torch.bfloat16, device=DEV)
    assert kernels._gemv_route(x, dense) == shared._gemv_route(x, dense)  # 16-bit weights keep the GEMV
    out, expected = kernels.linear(x, w), shared.linear(x, w)
    reference = x.float() @ w.dequantize().t()
    assert ((out.float() - reference).norm() / reference.norm()) < 0.02
    assert ((out.float() - expected.float()).norm() / reference.norm()) < 0.02
