"""core/ names no backend and no device type: every device fact comes from the Backend object. Read from the
syntax tree, so comments and prose are free to mention hardware while code, names and string values are not."""

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "core"
# Backends that exist or are planned, and torch's device-type names for them.
NAMES = {"cpu", "cuda", "rocm", "hip", "jetson", "rknpu", "npu", "mps", "xpu"}


def offences(source: str) -> list[str]:
    """Each use of a backend / device-type name as an identifier, attribute or whole string value, and each
    comparison of a device's `.type` with anything (a device type test)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id.lower() in NAMES:
            found.append(f"{node.lineno}: name {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr.lower() in NAMES:
            found.append(f"{node.lineno}: attribute .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip().lower() in NAMES:
            found.append(f"{node.lineno}: string {node.value!r}")
        elif isinstance(node, ast.Compare) and any(_is_device_type(s) for s in [node.left, *node.comparators]):
            found.append(f"{node.lineno}: compares a device's .type")
    return found


def _is_device_type(node: ast.AST) -> bool:
    """`device.type`, `x.device.type`, `backend.device().type`: the type of something named a device."""
    if not (isinstance(node, ast.Attribute) and node.attr == "type"):
        return False
    owner = node.value.func if isinstance(node.value, ast.Call) else node.value
    name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
    return "device" in name.lower()


@pytest.mark.parametrize(
    "source,caught",
    [
        ('torch.device("cpu")', True),
        ("torch.cuda.synchronize()", True),
        ('if device.type == "mps": pass', True),
        ("x = cuda", True),
        ("if backend.device().type != other: pass", True),
        ('if scaling.type == "linear": pass', False),
        ("# CUDA graphs replay here\nx = profile.cuda_graphs", False),
        ('"""the Jetson backend"""', False),
        ('name = "flashnext_cuda_graph_captures"', False),
    ],
)
def test_the_check_catches_what_it_should(source, caught):
    assert bool(offences(source)) is caught


def test_core_names_no_backend_and_no_device_type():
    found = {str(p.relative_to(CORE)): offences(p.read_text()) for p in sorted(CORE.rglob("*.py"))}
    assert {path: lines for path, lines in found.items() if lines} == {}
