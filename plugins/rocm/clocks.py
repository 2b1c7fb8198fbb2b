"""The HBM clock check: a memory clock left below its maximum while the GPU works costs about a third of decode
speed (decode streams the weights and the KV cache from HBM). Read through amdsmi, else rocm-smi's text, else its
JSON (which names the current level only)."""

import contextlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

import torch

from .device import amdsmi_session

REMEDY = (
    "raise it with `sudo amd-smi set --perf-level HIGH` (or `rocm-smi --setperflevel high`), or pin clocks "
    "with a performance-determinism mode (`amd-smi set --perf-determinism`, `rocm-smi --setperfdeterminism`)"
    " or, where the GPU has power profiles, the COMPUTE one (`rocm-smi --showprofile`, then --setprofile)"
)


@dataclass
class MemoryClock:
    gpu: int
    mhz: float | None  # None: the driver reports no value ("N/A")
    max_mhz: float | None
    locked: bool | None = None  # amdsmi: clocks pinned (performance determinism)

    @property
    def low(self) -> bool:
        return self.mhz is not None and self.max_mhz is not None and self.mhz < self.max_mhz


@dataclass
class ClockReport:
    clocks: list[MemoryClock]
    source: str  # "amdsmi", "rocm-smi", "rocm-smi --json", or why nothing could be read

    @property
    def low(self) -> list[MemoryClock]:
        return [c for c in self.clocks if c.low]

    @property
    def readable(self) -> bool:
        return bool(self.clocks) and all(c.mhz is not None and c.max_mhz is not None for c in self.clocks)

    def summary(self) -> str:
        if not self.clocks:
            return f"memory clock unknown: {self.source}"
        parts = [f"GPU {c.gpu} {_mhz(c.mhz)} of {_mhz(c.max_mhz)}" for c in self.clocks]
        return f"memory clock ({self.source}): {', '.join(parts)}"

    def problem(self) -> str | None:
        """One line naming the GPUs whose HBM runs below its maximum, and the remedy; None when all are at it."""
        if not self.low:
            return None
        gpus = ", ".join(f"GPU {c.gpu} at {_mhz(c.mhz)} of {_mhz(c.max_mhz)}" for c in self.low)
        return (
            f"HBM memory clock below its maximum under load ({gpus}; {self.source}): decode runs about a third "
            f"slower; {REMEDY}"
        )

    def as_facts(self) -> dict:
        return {
            "source": self.source,
            "gpus": [{"gpu": c.gpu, "mhz": c.mhz, "max_mhz": c.max_mhz, "locked": c.locked} for c in self.clocks],
        }


def _mhz(value: float | None) -> str:
    return "N/A" if value is None else f"{value:g} MHz"


def _number(value) -> float | None:
    """amdsmi reports what the driver lacks as the string "N/A"."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def serving_gpu(environ=os.environ) -> int | None:
    """The driver's number (amdsmi's and rocm-smi's order) of the GPU torch calls device 0, the one a check loads:
    ROCR_VISIBLE_DEVICES picks from the driver's GPUs, then HIP_VISIBLE_DEVICES (else CUDA_VISIBLE_DEVICES) from
    those. None when a list names GPUs by UUID, which maps to no number here: then every GPU is read."""
    visible: list[int] | None = None  # None: all of them, in the driver's order
    for names in (("ROCR_VISIBLE_DEVICES",), ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")):
        value = next((environ[name] for name in names if name in environ), None)
        if value is None:
            continue
        picks = [p.strip() for p in value.split(",") if p.strip()]
        if not all(p.isdigit() for p in picks):
            return None
        visible = (
            [int(p) for p in picks] if visible is None else [visible[int(p)] for p in picks if int(p) < len(visible)]
        )
    if visible is None:
        return 0
    return visible[0] if visible else None


def read_memory_clocks(gpu: int | None = None) -> ClockReport:
    """Every GPU's memory clock, or only that of the driver's GPU `gpu` where the tools list it."""
    report = _read_all_memory_clocks()
    mine = [c for c in report.clocks if c.gpu == gpu]
    return ClockReport(mine, report.source) if mine else report


def _read_all_memory_clocks() -> ClockReport:
    with amdsmi_session() as smi:
        if smi is None:
            failed = "amdsmi is not installed (pip install amdsmi) or cannot reach the driver"
        else:
            try:
                handles = smi.amdsmi_get_processor_handles()
                return ClockReport([_amdsmi_clock(smi, i, h) for i, h in enumerate(handles)], "amdsmi")
            except smi.AmdSmiException as exc:
                failed = f"amdsmi failed ({exc})"
    if shutil.which("rocm-smi") is None:
        return ClockReport([], f"{failed}, and rocm-smi is not on PATH")
    clocks = parse_rocm_smi_text(_run(["rocm-smi", "--showclocks", "--showclkfrq"]))
    if clocks:
        return ClockReport(clocks, "rocm-smi")
    clocks = parse_rocm_smi_json(_run(["rocm-smi", "--showclocks", "--json"]))
    return ClockReport(clocks, "rocm-smi --json") if clocks else ClockReport([], "rocm-smi printed no mclk")


def _amdsmi_clock(smi, index: int, handle) -> MemoryClock:
    info = smi.amdsmi_get_clock_info(handle, smi.AmdSmiClkType.MEM)
    current = info.get("clk", info.get("cur_clk"))  # ROCm 5.7 named it cur_clk
    locked = info.get("clk_locked")
    return MemoryClock(
        index, _number(current), _number(info.get("max_clk")), locked if isinstance(locked, bool) else None
    )


def _run(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


_GPU_LINE = re.compile(r"^GPU\[(\d+)\]\s*:\s*(.*)$")
_CURRENT = re.compile(r"mclk clock level:\s*\w+:\s*\((\d+(?:\.\d+)?)Mhz\)", re.IGNORECASE)
_LEVEL = re.compile(r"^\w+:\s*(\d+(?:\.\d+)?)Mhz", re.IGNORECASE)


def parse_rocm_smi_text(text: str) -> list[MemoryClock]:
    """`rocm-smi --showclocks --showclkfrq`: 'GPU[0]\\t\\t: mclk clock level: 0: (900Mhz)' for the clock now, and
    under 'Supported mclk frequencies on GPU0' one '0: 900Mhz *' line a level, the highest being the maximum."""
    current: dict[int, float] = {}
    levels: dict[int, list[float]] = {}
    section: str | None = None
    for line in text.splitlines():
        match = _GPU_LINE.match(line.strip())
        if not match:
            continue
        gpu, rest = int(match.group(1)), match.group(2).strip()
        if rest.lower().startswith("supported"):
            section = "mclk" if " mclk " in f" {rest.lower()} " else None
            continue
        if found := _CURRENT.search(rest):
            current[gpu] = float(found.group(1))
        elif section == "mclk" and (level := _LEVEL.match(rest)):
            levels.setdefault(gpu, []).append(float(level.group(1)))
        elif not rest:
            section = None
    return [
        MemoryClock(g, current.get(g), max(levels[g]) if g in levels else None)
        for g in sorted(set(current) | set(levels))
    ]


def parse_rocm_smi_json(text: str) -> list[MemoryClock]:
    """`rocm-smi --showclocks --json`: {"card0": {"mclk clock speed:": "(900Mhz)", "mclk clock level:": "0"}}. It
    lists no supported levels, so the maximum stays unknown."""
    try:
        cards = json.loads(text)
    except ValueError:
        return []
    out = []
    for card, fields in cards.items() if isinstance(cards, dict) else ():
        found = re.search(r"(\d+(?:\.\d+)?)\s*Mhz", str(fields.get("mclk clock speed:", "")), re.IGNORECASE)
        if card.startswith("card") and card[4:].isdigit() and found:
            out.append(MemoryClock(int(card[4:]), float(found.group(1)), None))
    return out


@contextlib.contextmanager
def memory_traffic(device: torch.device, mib: int = 256, copies: int = 2000):
    """Keeps HBM busy while the clock is read: idle HBM drops to its lowest level by design, so only a reading
    under load tells a clock that was left low. The copies are queued before the read and waited for after it."""
    if device.type != "cuda" or not torch.cuda.is_available():
        yield
        return
    src = torch.empty(mib << 18, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    for _ in range(copies):
        dst.copy_(src)
    try:
        yield
    finally:
        torch.cuda.synchronize(device)
