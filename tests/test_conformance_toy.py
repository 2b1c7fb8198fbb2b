"""examples/flashnext-toy-backend, pip-installed the way a user would, is found, allowlisted and passes the suite."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conformance_helpers import conformance, env_with, listed

EXAMPLE = Path(__file__).parent.parent / "examples" / "flashnext-toy-backend"


def _can_build_offline() -> bool:
    """setuptools >= 70.1 builds wheels by itself; older ones need the `wheel` package."""
    import setuptools

    major, minor = (int(p) for p in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("toy")
    src = shutil.copytree(EXAMPLE, work / "src")  # the build writes into the source tree: keep the repo clean
    site = work / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(site), str(src)]
    if _can_build_offline():
        cmd.insert(4, "--no-build-isolation")
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    assert (site / "flashnext_toy_backend-0.1.0.dist-info" / "entry_points.txt").is_file()
    return site


def test_toy_is_listed_with_its_origin_and_obeys_the_allowlist(toy_site):
    toy = listed(env_with([toy_site]))["toy"]
    assert toy["origin"] == "flashnext-toy-backend 0.1.0" and toy["available"] and toy["score"] < 1
    assert "toy" not in listed(env_with([toy_site], FLASHNEXT_PLUGINS=""))
    assert "toy" in listed(env_with([toy_site], FLASHNEXT_PLUGINS="other,toy"))
    assert "cpu" in listed(env_with([toy_site], FLASHNEXT_PLUGINS=""))  # in-tree backends ignore the allowlist


@pytest.mark.slow
def test_toy_passes_conformance_end_to_end(toy_site, tmp_path):
    code, report, _, proc = conformance("toy", tmp_path, env_with([toy_site]))
    assert code == 0, proc.stdout[-3000:]
    assert report["backend"] == "toy" and report["failed"] == 0 and report["skipped"] == 0
    e2e = {c["name"]: c for c in report["cases"] if c["name"].startswith("e2e_default_model")}
    assert e2e and all(c["passed"] for c in e2e.values()), e2e
    assert any(c["name"].startswith("rmsnorm[") and c["passed"] for c in report["cases"])
