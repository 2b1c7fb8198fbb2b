"""Run `flashnext conformance` / `flashnext backends` in a subprocess with extra plugin folders on PYTHONPATH."""

import json
import os
import subprocess
import sys
from pathlib import Path

FLASHNEXT = [sys.executable, "-c", "from flashnext.core.cli import main; main()"]


def env_with(paths: list[Path], **extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in paths] + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("FLASHNEXT_PLUGINS", None)
    env.pop("FLASHNEXT_BACKEND", None)
    env.update(extra)
    return env


def flashnext(args: list[str], env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(FLASHNEXT + args, env=env, capture_output=True, text=True, timeout=timeout)


def conformance(backend: str, tmp_path: Path, env: dict, select: str | None = None):
    """Returns (exit code, JSON report, JUnit path, completed process)."""
    report, junit = tmp_path / f"{backend}.json", tmp_path / f"{backend}.xml"
    args = ["conformance", "--backend", backend, "--json", str(report), "--junit", str(junit)]
    proc = flashnext(args + (["-k", select] if select else []), env)
    doc = json.loads(report.read_text()) if report.exists() else None
    return proc.returncode, doc, junit, proc


def listed(env: dict) -> dict[str, dict]:
    proc = flashnext(["backends", "--json"], env)
    assert proc.returncode == 0, proc.stderr
    return {b["name"]: b for b in json.loads(proc.stdout)}
