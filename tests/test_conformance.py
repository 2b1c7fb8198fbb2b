"""The conformance suite itself: its comparisons, its threshold table in docs, and the CPU backend passing it."""

import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from conformance_helpers import conformance, env_with, flashnext
from flashnext.conformance.checks import compare
from flashnext.conformance.thresholds import PRECISION_NAMES, THRESHOLDS, render_markdown
from flashnext.core.precision import PRECISIONS

DOCS = Path(__file__).parent.parent / "docs"
REPORT_KEYS = {"name", "backend", "precision", "metric", "threshold", "value", "passed"}


def test_threshold_table_is_the_one_in_docs():
    assert render_markdown() in (DOCS / "conformance.md").read_text(), "regenerate the table in docs/conformance.md"
    assert set(PRECISION_NAMES) == set(PRECISIONS), "every precision needs a column of bounds"
    assert set(THRESHOLDS) >= {
        "embedding",
        "rmsnorm",
        "add_rmsnorm",
        "rope",
        "store_kv",
        "attention",
        "linear",
        "silu_and_mul",
        "sample_tv",
    }


def test_nmse_is_relative_to_reference_power():
    ref = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    out = ref + torch.tensor([[0.5, 0.0], [0.0, 0.0]])
    c = compare(out, ref)
    assert math.isclose(c.nmse, 0.25 / 25) and c.fault is None and "(0, 0)" in c.where


@pytest.mark.parametrize(
    "got,want", [(float("nan"), 1.0), (float("inf"), -float("inf")), (1.0, float("inf")), (float("inf"), float("nan"))]
)
def test_nonfinite_must_agree_in_place_and_sign(got, want):
    ref = torch.tensor([1.0, 2.0, want])
    c = compare(torch.tensor([1.0, 2.0, got]), ref)
    assert c.fault is not None and "index (2,)" in c.fault


def test_matching_nonfinite_is_no_fault_and_rows_are_pointed_at():
    ref = torch.randn(10, 4)
    ref[2, 1] = float("-inf")
    out = ref.clone()
    out[7:] = 0.0  # rows a kernel never wrote
    c = compare(out, ref)
    assert c.fault is None and "3 of 10 rows" in c.where and "rows 7, 8, 9" in c.where


def test_shape_mismatch_is_a_fault():
    assert "shape" in compare(torch.zeros(2, 3), torch.zeros(3, 2)).fault


def test_cli_refuses_unknown_backend_and_empty_selection(tmp_path):
    env = env_with([])
    proc = flashnext(["conformance", "--backend", "nosuch"], env)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "nosuch" in proc.stderr
    proc = flashnext(["conformance", "--backend", "cpu", "-k", "no_case_has_this_name"], env)
    assert proc.returncode == 2 and "no conformance case matches" in proc.stderr
    proc = flashnext(["conformance", "--backend", "cpu", "--json", str(tmp_path / "missing" / "r.json")], env)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


@pytest.mark.slow
def test_cpu_backend_passes_the_whole_suite(tmp_path):
    code, report, junit, proc = conformance("cpu", tmp_path, env_with([]))
    assert code == 0, proc.stdout[-3000:]
    cases = report["cases"]
    assert report["backend"] == "cpu" and report["failed"] == 0 and len(cases) > 300
    assert all(set(c) >= REPORT_KEYS for c in cases)
    assert all(c["passed"] for c in cases if c["name"] != "e2e_default_model")
    e2e = next(c for c in cases if c["name"] == "e2e_default_model")  # the one skip: cpu is the reference
    assert e2e["passed"] is None and "reference" in e2e["message"]
    names = {c["name"].split("[")[0].split("::")[0] for c in cases}
    assert {
        "embedding",
        "rmsnorm",
        "add_rmsnorm",
        "rope",
        "store_kv",
        "attention",
        "linear",
        "silu_and_mul",
        "sample",
        "fp8_format",
        "int4_format",
        "quantized_on_the_device",
        "gguf_q4",
        "engine_precision",
        "feature",
        "prefix_cache_hit_equals_miss",
        "batch_invariance",
        "seeded_determinism",
    } <= names
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("failures") == "0" and int(suite.get("tests")) > 100
    assert "flashnext conformance" in proc.stdout and "0 failed" in proc.stdout


@pytest.mark.slow
def test_the_suite_runs_the_profile_the_environment_sets(tmp_path):
    """FLASHNEXT_<FIELD> settings reach the engine cases, as they reach `run`: the int4 logits move with the route."""
    values = {}
    for route in ("onnxruntime", "onnxruntime-int8"):
        folder = tmp_path / route
        folder.mkdir()
        env = env_with([], FLASHNEXT_INT4_ROUTE=route)
        code, report, _, proc = conformance("cpu", folder, env, select="engine_precision and int4")
        assert code == 0, proc.stdout[-2000:]
        assert report["executed_on"] == f"profile 'full', int4_route {route}"
        case = next(c for c in report["cases"] if c["name"] == "engine_precision[int4]::vs reference")
        values[route] = case["value"]
    assert values["onnxruntime-int8"] > 2 * values["onnxruntime"]  # int8 activations: observed 4.8e-4 vs 5.5e-5
