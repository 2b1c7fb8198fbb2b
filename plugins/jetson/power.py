"""Power mode, GPU clock and load, temperatures: what decides whether a Jetson decodes at full speed. Every reader
takes the root path the probe reads, and the nvpmodel runner can be swapped (tests, fixtures)."""

import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .board import read_text

GPU_NODE_NAMES = ("ga10b", "gv11b", "gp10b")  # devfreq of_node names of the nvgpu-driven GPUs: Orin is ga10b
# Thor's GPU runs on nvidia.ko, without a device-tree node: its devfreq entry is the GPC clock domain, which
# jetson-stats reads.
THOR_GPU_ENTRY = "gpu-gpc-0"
THERMAL_MARGIN_C = 10.0  # closer than this to a trip point, the board is about to throttle
THROTTLING_TRIPS = ("passive", "hot", "critical")  # "active" trips only start a fan

Runner = Callable[[list[str]], str | None]


def run_command(argv: list[str]) -> str | None:
    """stdout of a short command, or None when it is absent or fails (nvpmodel needs no root to query)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


@dataclass
class PowerMode:
    name: str
    id: int | None

    @property
    def is_maximum(self) -> bool:
        # MAXN (MAXN_SUPER on JetPack 6.2) is the unconstrained mode. Orin Nano before JetPack 6.2 has none: its
        # mode 0 (15W) is its highest. On 6.2 that 15W mode 0 passes too, though MAXN_SUPER is faster.
        return "MAXN" in self.name.upper() or self.id == 0


def parse_nvpmodel(text: str) -> PowerMode | None:
    """`nvpmodel -q`: 'NV Power Mode: MAXN' then the mode id on the next line."""
    match = re.search(r"NV Power Mode:[ \t]*(\S+)[ \t]*(?:\r?\n[ \t]*(\d+))?", text)
    if match is None:
        return None
    return PowerMode(match.group(1), int(match.group(2)) if match.group(2) else None)


def read_power_mode(root: Path, run: Runner = run_command) -> PowerMode | None:
    return parse_nvpmodel(run([str(root / "usr/sbin/nvpmodel"), "-q"]) or "")


@dataclass
class GpuClock:
    node: str
    cur_mhz: float | None
    max_mhz: float | None
    load_ratio: float | None  # device/load is per-mille


def read_gpu_clock(root: Path) -> GpuClock | None:
    """The /sys/class/devfreq entry of the GPU (tegrastats and jtop read the same files)."""
    devfreq = root / "sys/class/devfreq"
    for entry in sorted(devfreq.glob("*")) if devfreq.is_dir() else []:
        node = entry.name if entry.name == THOR_GPU_ENTRY else read_text(entry / "device/of_node/name", [])
        if node not in (*GPU_NODE_NAMES, THOR_GPU_ENTRY):
            continue
        cur, top = _mhz(_number(entry / "cur_freq")), _mhz(_number(entry / "max_freq"))
        load = _number(entry / "device/load")
        load = _number(entry / "load") if load is None else load
        return GpuClock(node, cur, top, load / 1000 if load is not None else None)
    return None


def _mhz(freq: float | None) -> float | None:
    """devfreq speaks Hz, but jetson-stats reads Thor's GPC domain as kHz: no GPU runs under 10 MHz, so a smaller
    number is kHz."""
    if freq is None:
        return None
    return freq / 1e6 if freq >= 1e7 else freq / 1e3


@dataclass
class ThermalZone:
    name: str
    celsius: float
    trips: list[tuple[str, float]] = field(default_factory=list)  # (type, celsius)

    @property
    def nearest_trip(self) -> tuple[str, float] | None:
        hot = [t for t in self.trips if t[0] in THROTTLING_TRIPS and t[1] > 0]
        return min(hot, key=lambda t: t[1]) if hot else None


def read_thermal_zones(root: Path) -> list[ThermalZone]:
    zones = []
    base = root / "sys/class/thermal"
    for zone in sorted(base.glob("thermal_zone*")) if base.is_dir() else []:
        problems: list[str] = []
        name, temp = read_text(zone / "type", problems), _number(zone / "temp")
        if name is None or temp is None or temp < -40_000:  # an unpowered sensor reads -256 C
            continue
        trips = []
        for trip in sorted(zone.glob("trip_point_*_temp")):
            kind = read_text(zone / trip.name.replace("_temp", "_type"), problems)
            value = _number(trip)
            if kind is not None and value is not None:
                trips.append((kind, value / 1000))
        zones.append(ThermalZone(name, temp / 1000, trips))
    return zones


def warnings(mode: PowerMode | None, zones: list[ThermalZone]) -> list[str]:
    out = []
    if mode is not None and not mode.is_maximum:
        out.append(
            f"power mode {mode.name} (id {mode.id}) is not MAXN: the GPU clock is capped; "
            "`sudo nvpmodel -m <MAXN's id>` (ids are in /etc/nvpmodel.conf) for full speed"
        )
    for zone in zones:
        trip = zone.nearest_trip
        if trip is not None and zone.celsius >= trip[1] - THERMAL_MARGIN_C:
            out.append(
                f"{zone.name} is at {zone.celsius:.1f} C, within {THERMAL_MARGIN_C:.0f} C of its {trip[0]} "
                f"trip point ({trip[1]:.1f} C): clocks will throttle; improve cooling or lower the load"
            )
    return out


_TEGRA_RAM = re.compile(r"RAM (\d+)/(\d+)MB")
_TEGRA_GPU = re.compile(r"GR3D_FREQ (\d+)%(?:@\[?([\d,]+)\]?)?")
_TEGRA_TEMP = re.compile(r"(\w+)@(-?[\d.]+)C\b")
_TEGRA_RAIL = re.compile(r"(VDD_\w+|VIN_\w+) (\d+)mW/(\d+)mW")


def parse_tegrastats(line: str) -> dict:
    """One tegrastats line (JetPack 5, 6 or 7) -> RAM, GPU load and clock, temperatures, rail power."""
    out: dict = {}
    if ram := _TEGRA_RAM.search(line):
        out["ram_used_mb"], out["ram_total_mb"] = int(ram.group(1)), int(ram.group(2))
    if gpu := _TEGRA_GPU.search(line):
        out["gpu_load_ratio"] = int(gpu.group(1)) / 100
        if gpu.group(2):  # JetPack 7 lists one clock per GPC: [1300,1300]
            out["gpu_clock_mhz"] = max(int(f) for f in gpu.group(2).split(","))
    temps = {name.lower(): float(value) for name, value in _TEGRA_TEMP.findall(line)}
    if temps:
        out["temperature_celsius"] = temps
    rails = {name: int(now) for name, now, _avg in _TEGRA_RAIL.findall(line)}
    if rails:
        out["power_mw"] = rails
    return out


def _number(path: Path) -> float | None:
    text = read_text(path, [])
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None
