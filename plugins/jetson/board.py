"""Which Jetson this is: L4T release, JetPack, SoC, module and compute capability, read from files under a root
path (`/` on a board, a fixture folder in tests and in the discrete-GPU switch)."""

import re
from dataclasses import dataclass, field
from pathlib import Path

# L4T release -> JetPack, from NVIDIA's JetPack archive (developer.nvidia.com/embedded/jetpack-archive) as
# jetson-stats (jtop/core/jetson_variables.py) and JetPack CMake version tables list it. A release missing here
# falls back to its major line: R35 is JetPack 5.1.x (35.1.0 alone was 5.0.2), R36 is 6.x, R38 is 7.x.
JETPACK_BY_L4T = {
    "35.1.0": "5.0.2",
    "35.2.1": "5.1",
    "35.3.1": "5.1.1",
    "35.4.1": "5.1.2",
    "35.5.0": "5.1.3",
    "35.6.0": "5.1.4",
    "36.3.0": "6.0",
    "36.4.0": "6.1",
    "36.4.3": "6.2",
    "36.4.4": "6.2.1",
    "38.2.0": "7.0",
}
JETPACK_LINE = {"35": "5.1.x", "36": "6.x", "38": "7.x"}

# SoC (last entry of the device tree's compatible list) -> (family, compute capability). Thor reports 11.0 under
# CUDA 13 (sm_110; CUDA 12.8 / 12.9 called it 10.1): torch's own answer wins where a CUDA torch runs.
SOCS = {
    "tegra234": ("Orin", (8, 7)),
    "tegra264": ("Thor", (11, 0)),
}

# Module part numbers (nvidia,boardids) -> module name and memory, from NVIDIA's module data sheets and the
# Jetson Linux developer guide's module table.
MODULES = {
    "p3701-0000": ("Jetson AGX Orin 32GB", 32),
    "p3701-0004": ("Jetson AGX Orin 32GB", 32),
    "p3701-0005": ("Jetson AGX Orin 64GB", 64),
    "p3701-0008": ("Jetson AGX Orin Industrial 64GB", 64),
    "p3767-0000": ("Jetson Orin NX 16GB", 16),
    "p3767-0001": ("Jetson Orin NX 8GB", 8),
    "p3767-0003": ("Jetson Orin Nano 8GB", 8),
    "p3767-0004": ("Jetson Orin Nano 4GB", 4),
    "p3767-0005": ("Jetson Orin Nano 8GB (developer kit)", 8),
    "p3834-0008": ("Jetson AGX Thor T5000", 128),
}

_RELEASE = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)")


@dataclass
class Board:
    root: Path
    model: str | None = None  # /proc/device-tree/model
    soc: str | None = None  # e.g. tegra234
    module: str | None = None  # from nvidia,boardids
    part_number: str | None = None
    module_memory_gib: int | None = None
    l4t: str | None = None  # e.g. 36.4.3
    problems: list[str] = field(default_factory=list)  # files that were missing or unreadable

    @property
    def is_tegra(self) -> bool:
        return self.soc is not None and self.soc.startswith("tegra")

    @property
    def family(self) -> str | None:
        return SOCS.get(self.soc or "", (None, None))[0]

    @property
    def capability(self) -> tuple[int, int] | None:
        return SOCS.get(self.soc or "", (None, None))[1]

    @property
    def jetpack(self) -> str | None:
        if self.l4t is None:
            return None
        return JETPACK_BY_L4T.get(self.l4t) or JETPACK_LINE.get(self.l4t.split(".")[0])

    @property
    def name(self) -> str:
        return self.module or self.model or (f"{self.family} ({self.soc})" if self.family else "unknown board")

    def facts(self) -> dict:
        out = {
            "board": self.name,
            "model": self.model,
            "soc": self.soc,
            "part_number": self.part_number,
            "l4t": self.l4t,
            "jetpack": self.jetpack,
        }
        if self.problems:
            out["unreadable"] = self.problems
        return {k: v for k, v in out.items() if v is not None}


def read_text(path: Path, problems: list[str]) -> str | None:
    """A sysfs / procfs / device-tree file's text (device-tree strings end in NUL), or None, noting why."""
    try:
        return path.read_bytes().decode("utf-8", "replace").strip("\x00\n ")
    except FileNotFoundError:
        problems.append(f"{path}: missing")
    except OSError as exc:
        problems.append(f"{path}: {exc.strerror or exc}")
    return None


def parse_release(text: str) -> str | None:
    """`# R36 (release), REVISION: 4.3, ...` -> '36.4.3'."""
    match = _RELEASE.search(text)
    if match is None:
        return None
    major, revision = match.groups()
    parts = revision.split(".") + ["0"]
    return f"{major}.{parts[0]}.{parts[1]}"


def parse_boardids(text: str) -> str | None:
    """nvidia,boardids -> 'p3701-0005': written `p3701-0005` or `3701:0005:...` depending on the bootloader."""
    match = re.match(r"p?(\d{4})[-:](\d{4})", text.strip())
    return f"p{match.group(1)}-{match.group(2)}" if match else None


def read_board(root: Path) -> Board:
    board = Board(root)
    tree = root / "proc/device-tree"
    release = read_text(root / "etc/nv_tegra_release", board.problems)
    if release is not None:
        board.l4t = parse_release(release)
        if board.l4t is None:
            board.problems.append(f"{root / 'etc/nv_tegra_release'}: no '# R<n> (release), REVISION: x.y' line")
    board.model = read_text(tree / "model", board.problems)
    compatible = read_text(tree / "compatible", board.problems)
    if compatible:
        last = compatible.split("\x00")[-1]
        board.soc = last.split(",")[-1] if last.startswith("nvidia,") else None
    boardids = read_text(tree / "nvidia,boardids", board.problems)
    if boardids:
        board.part_number = parse_boardids(boardids)
        board.module, board.module_memory_gib = MODULES.get(board.part_number or "", (None, None))
    return board
