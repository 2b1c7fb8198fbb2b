"""What an RK3588 board shows of itself. Every reader takes the filesystem root, so fixture trees stand in for a
board in tests (tests/fixtures/rk3588/)."""

import contextlib
import re
from pathlib import Path

SOCS = ("rockchip,rk3588s", "rockchip,rk3588")
RUNTIME_LIBRARY_DIRS = ("usr/lib", "usr/lib64", "usr/lib/aarch64-linux-gnu", "usr/local/lib")
NPU_DEVFREQ = "sys/class/devfreq/fdab0000.npu"
DEBUGFS = "sys/kernel/debug/rknpu"
ROOT_ONLY = "unreadable: root only (debugfs)"


def compatible(root: Path) -> list[str]:
    """The device tree's compatible strings (NUL-separated), board first, SoC last; [] off a device-tree machine."""
    try:
        raw = (root / "proc/device-tree/compatible").read_bytes()
    except OSError:
        return []
    return [part.decode("ascii", "replace") for part in raw.split(b"\0") if part]


def soc(strings: list[str]) -> str | None:
    """'rk3588' or 'rk3588s' when the device tree names one."""
    return next((s.split(",")[1] for s in SOCS if s in strings), None)


def runtime_library(root: Path) -> Path | None:
    return next(
        (root / d / "librknnrt.so" for d in RUNTIME_LIBRARY_DIRS if (root / d / "librknnrt.so").is_file()), None
    )


def _debugfs(root: Path, name: str) -> str | None:
    """A debugfs file's text; raises PermissionError off root."""
    try:
        return (root / DEBUGFS / name).read_text()
    except FileNotFoundError:
        return None


def driver_version(root: Path) -> str:
    """'0.9.8' from 'RKNPU driver: v0.9.8'; says so when only root may read it."""
    try:
        text = _debugfs(root, "version")
    except PermissionError:
        return ROOT_ONLY
    if text is None:
        return "absent (no rknpu debugfs: driver not loaded or debugfs not mounted)"
    found = re.search(r"v?(\d+\.\d+\.\d+)", text)
    return found.group(1) if found else f"unrecognised: {text.strip()[:60]!r}"


def npu_load(root: Path) -> dict[str, int] | str:
    """{'core0': 12, ...} percent busy, from 'NPU load:  Core0: 12%, Core1:  5%, Core2:  0%,'."""
    try:
        text = _debugfs(root, "load")
    except PermissionError:
        return ROOT_ONLY
    if text is None:
        return "absent"
    cores = {f"core{i}": int(p) for i, p in re.findall(r"Core(\d+):\s*(\d+)%", text)}
    return cores or f"unrecognised: {text.strip()[:60]!r}"


def npu_clock(root: Path) -> dict:
    """The NPU's devfreq: current frequency (Hz), governor, available frequencies; {} where absent."""
    base = root / NPU_DEVFREQ
    facts = {}
    try:
        facts["npu_freq_hz"] = int((base / "cur_freq").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return facts
    for name in ("governor", "available_frequencies"):
        with contextlib.suppress(OSError):
            facts[f"npu_{name}"] = (base / name).read_text().strip()
    return facts


def board_facts(root: Path) -> dict:
    strings = compatible(root)
    library = runtime_library(root)
    facts = {"soc": soc(strings), "compatible": strings, "librknnrt": str(library) if library else None}
    if facts["soc"]:
        facts |= {"rknpu_driver": driver_version(root), "npu_load": npu_load(root), **npu_clock(root)}
    return facts
