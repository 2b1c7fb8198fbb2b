"""The project speaks of itself, not of how it was built: no work-log labels, no tracker numbers, no paths outside
the repository. Contracts live in docs/cli.md, numbers in docs/benchmarks.md with their dates and commits."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each pattern is built with "+" so that this file does not match itself (the formatter joins adjacent literals).
FORBIDDEN = re.compile(
    "|".join(
        [
            r"\bsess" + r"ions?\s+[0-9]",  # work-log labels
            r"\bdevice\s+" + r"(machine|time)\b",  # who ran it where, not the machine itself (e.g. "the H200")
            r"\bissues?\s+#?" + r"[0-9]",  # tracker numbers
            r"(?<![\w&/#])#" + r"[0-9]+\b",  # a hash sign then digits
            r"\.\./" + r"shared\b",  # paths outside the repository
            r"\bshared/" + r"[A-Z]+\.md",
        ]
    ),
    re.IGNORECASE,
)


def project_files() -> list[str]:
    """Tracked files and new ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    return sorted({name for name in out.decode().split("\0") if name and (ROOT / name).is_file()})


def offending_lines(text: str) -> list[tuple[int, str]]:
    return [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1) if FORBIDDEN.search(line)]


def test_the_pattern_finds_each_kind_of_wording():
    samples = [
        "as measured in sess" + "ion 12",
        "ran on the device " + "machine",
        "no device " + "time left",
        "see iss" + "ue 4",
        "fixed in #" + "42",
        "../sha" + "red/HARDWARE.md",
        "names: sha" + "red/DESIGN.md",
    ]
    assert all(offending_lines(sample) for sample in samples)
    fine = [
        "the H200 decodes 1,534 tok/s",
        "a session cookie",
        "issue-bound kernels",
        "color: #fff",
        "# 1 row a program",
        "shared memory",
        "docs/cli.md",
    ]
    assert not any(offending_lines(sample) for sample in fine)


def test_no_file_speaks_of_how_the_project_was_built():
    hits = []
    for name in project_files():
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary files carry no wording
        hits += [f"{name}:{number}: {line[:120]}" for number, line in offending_lines(text)]
    assert not hits, "say what, not when or by whom (e.g. 'the H200', a date, docs/cli.md):\n" + "\n".join(hits)
