"""What the ROCm backend knows about AMD GPUs: gfx targets, product names, and reading them from torch / amdsmi.

Features are gated on the gfx target name. torch's (major, minor) on ROCm is the gfx number (MI300X: 9.4,
MI210: 9.0, RX 7900: 11.0), so a CUDA-style `>= (8, 9)` FP8 test would pass on GPUs without FP8.
"""

import contextlib
from dataclasses import dataclass

import torch

FNUZ = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)  # fp8-e4m3 / fp8-e5m2 storage on gfx942
OCP = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class GfxTarget:
    family: str
    fp8: tuple[torch.dtype, torch.dtype] | None  # storage of fp8-e4m3 and fp8-e5m2; None: no FP8 here
    flash_attn: bool  # ROCm flash attention's Composable Kernel build runs on this target


GFX_TARGETS = {
    "gfx942": GfxTarget("CDNA 3: MI300X, MI325X, MI300A", FNUZ, True),
    "gfx950": GfxTarget("CDNA 4: MI350X, MI355X", OCP, True),
    "gfx90a": GfxTarget("CDNA 2: MI210, MI250, MI250X", None, True),
    "gfx1100": GfxTarget("RDNA 3: Radeon RX 7900 XTX / XT, Radeon PRO W7900", None, False),
}
OTHER_TARGET = GfxTarget("not a target this backend is tested for", None, False)

# PCI device ids as vLLM maps them: these boards' torch device names are often generic.
PRODUCTS = {0x74A1: "AMD Instinct MI300X", 0x74A5: "AMD Instinct MI325X", 0x74B9: "AMD Instinct MI325X"}


@contextlib.contextmanager
def amdsmi_session():
    """The amdsmi module, initialized, or None where it is not installed or cannot reach the driver."""
    try:
        import amdsmi
    except (ImportError, OSError):  # the PyPI wheel raises OSError when libamd_smi.so is missing
        yield None
        return
    try:
        amdsmi.amdsmi_init()
    except amdsmi.AmdSmiException:
        yield None
        return
    try:
        yield amdsmi
    finally:
        with contextlib.suppress(amdsmi.AmdSmiException):
            amdsmi.amdsmi_shut_down()


def asic_info(index: int = 0) -> dict:
    """amdsmi's ASIC facts of GPU `index` ({} where amdsmi cannot tell): target_graphics_version, device_id,
    market_name, ..., with amdsmi's "N/A" strings for what the driver does not report."""
    with amdsmi_session() as smi:
        if smi is None:
            return {}
        try:
            handles = smi.amdsmi_get_processor_handles()
            return dict(smi.amdsmi_get_gpu_asic_info(handles[index])) if index < len(handles) else {}
        except smi.AmdSmiException:
            return {}


def gfx_name(props, asic: dict) -> str:
    """'gfx942' from torch's gcnArchName 'gfx942:sramecc+:xnack-', else from amdsmi; '' when neither says."""
    arch = (getattr(props, "gcnArchName", "") or "").split(":")[0].strip()
    if arch:
        return arch
    reported = str(asic.get("target_graphics_version", ""))
    return reported.lower() if reported.lower().startswith("gfx") else ""


def product_name(props, asic: dict) -> str:
    try:
        device_id = int(str(asic.get("device_id", "")), 16)
    except ValueError:
        device_id = None
    if device_id in PRODUCTS:
        return PRODUCTS[device_id]
    market = str(asic.get("market_name", "")).strip()
    return props.name or (market if market and market != "N/A" else "AMD GPU")
