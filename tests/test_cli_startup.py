"""The CLI answers --help, --version and usage errors without importing torch (the cost a newcomer pays first)."""

import re
import statistics
import subprocess
import sys
import time

import pytest

from flashnext.core.cli import app

CLI = [sys.executable, "-X", "importtime", "-c", "from flashnext.core.cli import main; main()"]
COMMANDS = sorted(c.name or c.callback.__name__ for c in app.registered_commands)


def imported_modules(*args: str) -> tuple[int, str, set[str]]:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)
    modules = set(re.findall(r"^import time:.*\|\s+(\S+)$", proc.stderr, re.MULTILINE))
    return proc.returncode, proc.stdout + proc.stderr, modules


@pytest.mark.parametrize(
    "args, code",
    [
        (["--help"], 0),
        (["--version"], 0),
        (["no-such-command"], 2),
        (["run", "--max-tokens", "0", "hi"], 2),
        (["bench", "--prompt-len", "x"], 2),
    ],
)
def test_quick_answers_import_no_torch(args, code):
    returncode, output, modules = imported_modules(*args)
    assert returncode == code, output
    assert "torch" not in modules and "flashnext.core.llm" not in modules


@pytest.mark.parametrize("command", COMMANDS)
def test_every_commands_help_imports_no_torch(command):
    """A command's module keeps heavy imports inside its body (cli.py's pattern for adding one)."""
    returncode, output, modules = imported_modules(command, "--help")
    assert returncode == 0, output
    assert "torch" not in modules, f"`flashnext {command} --help` imports torch"


def test_version_names_the_package():
    from flashnext.core import __version__

    proc = subprocess.run(CLI[:1] + CLI[3:] + ["--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"flashnext {__version__}"


def wall_s(*cmd: str) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, capture_output=True, timeout=120)
    return time.perf_counter() - start


def test_help_takes_about_as_long_as_typers_own_help():
    """Wall time against a baseline taken at the same moment (a loaded CI machine slows both): the help needs
    typer and its rich help formatting and little besides; importing torch takes many times the baseline."""
    baseline = statistics.median(wall_s(sys.executable, "-c", "import typer.rich_utils") for _ in range(3))
    help_s = statistics.median(wall_s(*CLI[:1], *CLI[3:], "--help") for _ in range(3))
    assert help_s < 1.5 * baseline + 0.3, (help_s, baseline)
