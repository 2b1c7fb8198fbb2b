"""What a long step is doing, on stderr: rich progress bars on a terminal, one plain line per finished stage
otherwise (logs, CI). Shown only inside a command's `shown()` block, so the Python API stays quiet."""

import sys
import time
from contextlib import contextmanager

_state = {"on": False, "progress": None}


@contextmanager
def shown():
    _state["on"] = True
    try:
        yield
    finally:
        _state["on"] = False


def silence() -> None:
    """No more stages shown by this process (a tensor-parallel rank past 0: rank 0 reports for the group)."""
    _state["on"] = False


@contextmanager
def stage(description: str, total: int | None = None):
    """Yields `advance(note)`, to call after each of `total` parts (e.g. bench configurations); the plain line
    names the stage, its time and the last note."""
    if not _state["on"]:
        yield lambda note="": None
        return
    if sys.stderr.isatty():
        with _rich_task(description, total) as advance:
            yield advance
        return
    start, last = time.perf_counter(), {"note": "", "done": 0}

    def advance(note: str = "") -> None:
        last["note"] = note
        last["done"] += 1
        if total is not None:
            print(
                f"{description} {last['done']}/{total}: {note} ({time.perf_counter() - start:.1f} s)",
                file=sys.stderr,
                flush=True,
            )

    yield advance
    if total is None:
        note = f": {last['note']}" if last["note"] else ""
        print(f"{description}{note} ({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)


@contextmanager
def _rich_task(description: str, total: int | None):
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    outer = _state["progress"] is None
    if outer:
        columns = [
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[done]}"),
            TimeElapsedColumn(),
        ]
        _state["progress"] = Progress(*columns, console=Console(stderr=True), transient=True)
        _state["progress"].start()
    progress = _state["progress"]
    task = progress.add_task(description, total=total, done=f"0/{total}" if total else "")
    finished = [0]

    def advance(note: str = "") -> None:
        finished[0] += 1
        progress.update(
            task,
            advance=1,
            description=f"{description}: {note}" if note else description,
            done=f"{finished[0]}/{total}" if total else "",
        )

    try:
        yield advance
    finally:
        progress.remove_task(task)
        if outer:
            progress.stop()
            _state["progress"] = None
