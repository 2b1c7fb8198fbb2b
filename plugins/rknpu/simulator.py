"""Exported graphs in rknn-toolkit2's simulator, off the board: the toolkit lives in its own venv (it pins torch
<= 2.4), so a long-lived worker process started with that venv's python (toolkit_worker.py) builds each graph and
runs it, and `SimulatorSession` talks to it with `OnnxSession`'s interface."""

import atexit
import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from flashnext.core.errors import UserError

from .runtime import NpuRuntimeError
from .toolkit_worker import receive, send

TOOLKIT_PYTHON_ENV = "FLASHNEXT_RKNN_TOOLKIT_PYTHON"
# Where benchmarks/rknn_simulate.sh makes the toolkit's venv: the project's root.
DEFAULT_TOOLKIT_PYTHON = Path(__file__).resolve().parents[2] / ".venv-rknn" / "bin" / "python"
WORKER = Path(__file__).with_name("toolkit_worker.py")


def find_toolkit_python() -> str | None:
    """FLASHNEXT_RKNN_TOOLKIT_PYTHON (empty: none), else the project's .venv-rknn where it exists."""
    chosen = os.environ.get(TOOLKIT_PYTHON_ENV)
    if chosen is not None:
        return chosen or None
    return str(DEFAULT_TOOLKIT_PYTHON) if DEFAULT_TOOLKIT_PYTHON.is_file() else None


def graph_key(onnx_path: Path) -> str:
    """sha256 of a graph and the external weight files it names: equal exports share one build."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    files = sorted(
        {entry.value for tensor in model.graph.initializer for entry in tensor.external_data if entry.key == "location"}
    )
    digest = hashlib.sha256(onnx_path.read_bytes())
    for name in files:
        with open(onnx_path.parent / name, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


class ToolkitWorker:
    """The toolkit venv's python running toolkit_worker.py; its output goes to a log file named in every error."""

    def __init__(self, python: str):
        if not Path(python).is_file():
            raise UserError(
                f"{TOOLKIT_PYTHON_ENV}={python}: no such file; point it at the python of a venv with "
                "rknn-toolkit2 (benchmarks/rknn_simulate.sh makes .venv-rknn) or set it empty for onnxruntime"
            )
        self.python, self.failed, self.toolkit = python, False, "rknn-toolkit2"
        self.lock = threading.Lock()
        with tempfile.NamedTemporaryFile(prefix="flashnext-rknn-toolkit-", suffix=".log", delete=False) as log:
            self.log = Path(log.name)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log
            )
        self.toolkit = self._exchange({"op": "start"}, (), greeting=True)[0]["toolkit"]

    def alive(self) -> bool:
        return self.process.poll() is None

    def call(self, header: dict, arrays=()) -> tuple[dict, list[np.ndarray]]:
        with self.lock:
            return self._exchange(header, arrays)

    def _exchange(self, header: dict, arrays, greeting: bool = False) -> tuple[dict, list[np.ndarray]]:
        try:
            if not greeting:
                send(self.process.stdin, header, arrays)
            reply, outputs = receive(self.process.stdout)
        except (EOFError, OSError, ValueError):
            raise self._died(header) from None
        if not reply["ok"]:
            self.failed = True
            raise NpuRuntimeError(
                f"{header.get('onnx', 'graph')}: {self.toolkit} simulator {header['op']} failed: {reply['error']}; "
                f"its log: {self.log}"
            )
        return reply, outputs

    def _died(self, header: dict) -> NpuRuntimeError:
        try:
            code = self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        lines = self.log.read_text(errors="replace").strip().splitlines()
        last = lines[-1].strip() if lines else "(empty)"
        doing = "starting" if header["op"] == "start" else f"{header['op']} of {header.get('onnx', 'a graph')}"
        return NpuRuntimeError(
            f"the rknn-toolkit2 worker ({self.python}) exited with code {code} while {doing}; its last line: "
            f"{last!r}; full log: {self.log}; check that this python's venv has rknn-toolkit2 "
            "(benchmarks/rknn_simulate.sh makes one)"
        )

    def close(self) -> None:
        """End the worker (it exits when its stdin closes); its log stays only if it failed."""
        if self.alive():
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.returncode == 0 and not self.failed:
            self.log.unlink(missing_ok=True)


_WORKERS: dict[str, ToolkitWorker] = {}


def worker_for(python: str) -> ToolkitWorker:
    """One worker a toolkit python for the whole process (its built graphs are the cache); a dead one is replaced."""
    worker = _WORKERS.get(python)
    if worker is None or not worker.alive():
        worker = _WORKERS[python] = ToolkitWorker(python)
    return worker


@atexit.register
def _close_workers() -> None:
    for worker in _WORKERS.values():
        worker.close()


class SimulatorSession:
    """One exported graph built by rknn-toolkit2 for `target` and run in its simulator (fp16), in the worker of
    `python`; a graph already built there (same hash) is reused."""

    def __init__(self, path: Path, python: str, target: str = "rk3588"):
        self.path, self.worker = path, worker_for(python)
        self.key = graph_key(path)
        reply, _ = self.worker.call({"op": "load", "key": self.key, "onnx": str(path), "target": target})
        self.cached, self.build_s = reply["cached"], reply["build_s"]

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        return self.worker.call({"op": "run", "key": self.key, "onnx": str(self.path)}, inputs)[1]

    def release(self) -> None:
        self.worker = None  # the worker keeps the built graph: the next export with the same hash reuses it
