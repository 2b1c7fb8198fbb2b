"""Fakes for the rocm backend's tests: an `amdsmi` module with the real names and value shapes answering from a
fixture file, a `rocm-smi` executable printing fixture output, and a ROCm build of torch's device answers."""

import json
import os
import stat
import sys
import types
from enum import IntEnum
from pathlib import Path
from types import SimpleNamespace

import torch

from flashnext.plugins.rocm.attention import load_flash_attn

FIXTURES = Path(__file__).parent / "fixtures" / "rocm"


class AmdSmiException(Exception):
    pass


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int):
        self.err_code = err_code
        super().__init__(f"An error occurred with code: {err_code}")


class AmdSmiParameterException(AmdSmiException):
    pass


class AmdSmiClkType(IntEnum):  # the values of amdsmi.h's amdsmi_clk_type_t
    SYS = 0
    GFX = 0
    DF = 1
    DCEF = 2
    SOC = 3
    MEM = 4
    PCIE = 5
    VCLK0 = 6
    VCLK1 = 7
    DCLK0 = 8
    DCLK1 = 9


class amdsmi_processor_handle:  # noqa: N801 (amdsmi's own spelling)
    def __init__(self, index: int):
        self.index = index


def fake_amdsmi(fixture: str, init_fails: bool = False) -> types.ModuleType:
    """An `amdsmi` module answering from tests/fixtures/rocm/<fixture>; it counts init and shut-down calls."""
    gpus = json.loads((FIXTURES / fixture).read_text())["gpus"]
    mod = types.ModuleType("amdsmi")
    mod.calls = {"init": 0, "shut_down": 0}
    mod.AmdSmiException, mod.AmdSmiLibraryException = AmdSmiException, AmdSmiLibraryException
    mod.AmdSmiParameterException, mod.AmdSmiClkType = AmdSmiParameterException, AmdSmiClkType

    def amdsmi_init(flag=None):
        mod.calls["init"] += 1
        if init_fails:
            raise AmdSmiLibraryException(8)  # AMDSMI_STATUS_INIT_ERROR: the driver is not loaded

    def amdsmi_shut_down():
        mod.calls["shut_down"] += 1

    def amdsmi_get_processor_handles():
        return [amdsmi_processor_handle(i) for i in range(len(gpus))]

    def _gpu(handle):
        if not isinstance(handle, amdsmi_processor_handle):
            raise AmdSmiParameterException(f"{handle!r} is not an amdsmi_processor_handle")
        return gpus[handle.index]

    def amdsmi_get_gpu_asic_info(handle):
        return dict(_gpu(handle)["asic"])

    def amdsmi_get_clock_info(handle, clock_type):
        if not isinstance(clock_type, AmdSmiClkType):
            raise AmdSmiParameterException(f"{clock_type!r} is not an AmdSmiClkType")
        clocks = _gpu(handle)["clocks"]
        if clock_type.name not in clocks:
            raise AmdSmiLibraryException(2)  # AMDSMI_STATUS_NOT_SUPPORTED
        return dict(clocks[clock_type.name])

    for fn in (
        amdsmi_init,
        amdsmi_shut_down,
        amdsmi_get_processor_handles,
        amdsmi_get_gpu_asic_info,
        amdsmi_get_clock_info,
    ):
        setattr(mod, fn.__name__, fn)
    return mod


def install_rocm_smi(bin_dir: Path, text_fixture: str | None, json_fixture: str | None = None) -> Path:
    """A `rocm-smi` on PATH printing the fixtures: JSON for --json, text otherwise (nothing where None)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "rocm-smi"
    text = FIXTURES / text_fixture if text_fixture else None
    js = FIXTURES / json_fixture if json_fixture else None
    script.write_text(f"""#!{sys.executable}
import sys
path = {str(js) if js else None!r} if "--json" in sys.argv else {str(text) if text else None!r}
if path:
    sys.stdout.write(open(path).read())
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


# gcnArchName and (major, minor) as a ROCm torch reports them; (major, minor) is the gfx number, not a capability.
GPUS = {
    "mi300x": SimpleNamespace(
        name="AMD Instinct MI300X",
        gcnArchName="gfx942:sramecc+:xnack-",
        major=9,
        minor=4,
        total_memory=205822885888,
        multi_processor_count=304,
        is_integrated=False,
    ),
    "mi355x": SimpleNamespace(
        name="AMD Instinct MI355X",
        gcnArchName="gfx950:sramecc+:xnack-",
        major=9,
        minor=5,
        total_memory=309220868096,
        multi_processor_count=256,
        is_integrated=False,
    ),
    "mi210": SimpleNamespace(
        name="AMD Instinct MI210",
        gcnArchName="gfx90a:sramecc+:xnack-",
        major=9,
        minor=0,
        total_memory=68702699520,
        multi_processor_count=104,
        is_integrated=False,
    ),
    "rx7900": SimpleNamespace(
        name="AMD Radeon RX 7900 XTX",
        gcnArchName="gfx1100",
        major=11,
        minor=0,
        total_memory=25753026560,
        multi_processor_count=48,
        is_integrated=False,
    ),
}


def rocm_torch(monkeypatch, gpu: str, count: int = 1, hip: str = "6.4.43482") -> None:
    """This process's torch answers as a ROCm build of torch with `count` of GPUS[gpu]."""
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: GPUS[gpu])


def no_amdsmi(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # `import amdsmi` raises ImportError


def path_with_only(monkeypatch, bin_dir: Path) -> None:
    """PATH holds bin_dir and the system's directories, so rocm-smi is found exactly when the test put it there."""
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"]))


def reference_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flash_attn_varlen_func's contract computed with torch: GQA, causal mask aligned bottom-right."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe, ks, ke = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi, ki = q[qs:qe].float(), k[ks:ke].float().repeat_interleave(group, 1)
        vi = v[ks:ke].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * softmax_scale
        if causal:
            rows = torch.arange(qe - qs, device=q.device).unsqueeze(1) + (ke - ks) - (qe - qs)
            scores.masked_fill_(torch.arange(ke - ks, device=q.device).unsqueeze(0) > rows, float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vi).to(q.dtype)
    return out


def fake_flash_attn(monkeypatch) -> list[dict]:
    calls = []
    mod = types.ModuleType("flash_attn")

    def flash_attn_varlen_func(*args, **kwargs):
        names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
        calls.append(dict(zip(names, args)) | kwargs)
        return reference_varlen(*args, **kwargs)

    mod.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", mod)
    load_flash_attn.cache_clear()
    return calls
