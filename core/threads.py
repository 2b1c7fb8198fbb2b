"""How many CPU threads torch uses: the `threads` profile field, or a choice from the cores that are idle now.

On a machine another process keeps busy, an OpenMP team as wide as the machine waits at every barrier for the thread
that lost its core, so each op takes a scheduler time slice instead of microseconds; a team as wide as the idle
cores keeps its speed (docs/cli.md has the numbers). The auto choice therefore leaves out the cores other processes
were using at start-up, and never exceeds what this process was given (OMP_NUM_THREADS, torch.set_num_threads).
"""

import contextlib
import functools
import time
from dataclasses import dataclass

HELP = "CPU threads for torch (env FLASHNEXT_THREADS); default: the cores not busy with other processes."
SAMPLE_S = 0.1  # long enough to see a busy core, short enough to hide in the model load


@dataclass
class ThreadChoice:
    threads: int
    reason: str  # one line, for --explain and /health


def busy_cores_of_others(sample_s: float = SAMPLE_S) -> float:
    """Cores other processes kept busy over `sample_s` (this process's own use left out)."""
    import psutil

    me = psutil.Process()
    me.cpu_percent(None)
    psutil.cpu_percent(None)
    time.sleep(sample_s)
    total = psutil.cpu_percent(None) / 100 * (psutil.cpu_count() or 1)
    return max(0.0, total - me.cpu_percent(None) / 100)


@functools.cache
def busy_at_start_up() -> float:
    """One sample a process: every engine it builds sees the same choice."""
    return busy_cores_of_others()


def choose_threads(requested: int | None, busy: float | None = None) -> ThreadChoice:
    """`requested` as given; None: the physical cores less those other processes keep busy (at least one)."""
    import psutil
    import torch

    cores = psutil.cpu_count(logical=False) or psutil.cpu_count() or 1
    if requested is not None:
        return ThreadChoice(
            requested, f"{threads_text(requested)} as set (--threads / FLASHNEXT_THREADS); {cores} physical cores"
        )
    busy = busy_at_start_up() if busy is None else busy
    threads = max(1, min(torch.get_num_threads(), round(cores - busy)))
    return ThreadChoice(
        threads,
        f"{threads_text(threads)}: {cores} physical cores, {busy:.1f} busy with other "
        "processes at start-up (--threads N to override)",
    )


def apply_threads(choice: ThreadChoice) -> None:
    """Before any work: intra-op threads always; inter-op threads only while torch still allows setting them."""
    import torch

    torch.set_num_threads(choice.threads)
    with contextlib.suppress(RuntimeError):  # torch refuses once inter-op work has run in this process
        torch.set_num_interop_threads(choice.threads)


def from_setting(flag: int | None) -> ThreadChoice:
    """The flag, else FLASHNEXT_THREADS, else the auto choice."""
    from .profile import Profile, env_overrides

    return choose_threads(Profile().overridden(**env_overrides(), threads=flag).threads)


def apply_setting(flag: int | None) -> ThreadChoice:
    """from_setting, applied now: for work done before an LLM exists (random weights, the conformance suite)."""
    choice = from_setting(flag)
    apply_threads(choice)
    return choice


def threads_text(n: int) -> str:
    return f"{n} thread" if n == 1 else f"{n} threads"
