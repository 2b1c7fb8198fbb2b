"""`flashnext export --target T`: a model written out ahead of time for a backend that runs exported graphs.

Core names no backend: the target is looked up among the installed backends' `export_targets`, and that
backend's `export(target, loaded, out, **options)` writes the folder and returns its manifest."""

import json
from pathlib import Path
from typing import Annotated

import typer

from .errors import UserError


def export(
    target: Annotated[str, typer.Option(help="Device to export for, e.g. rk3588.")],
    out: Annotated[Path, typer.Option(help="Folder to write (graphs, tokenizer, config, manifest.json).")],
    model: Annotated[str | None, typer.Option(envvar="FLASHNEXT_MODEL", help="Folder, .gguf file or HF id.")] = None,
    precision: Annotated[str, typer.Option(help="Weight precision in the graphs, e.g. int4.")] = "int4",
    batch: Annotated[int, typer.Option(min=1, help="Sequences in the decode graph.")] = 4,
    chunk: Annotated[int, typer.Option(min=1, help="Tokens in the prefill graph.")] = 32,
    context: Annotated[int, typer.Option(min=16, help="Maximum context (tokens) the graphs hold.")] = 512,
    check: Annotated[bool, typer.Option(help="Check each graph against the core's forward pass.")] = True,
):
    """Export MODEL as static-shape graphs for TARGET into OUT."""
    from . import registry
    from .loader import load_model

    entries = [e for e in registry.discover() if e.backend and target in getattr(e.backend, "export_targets", ())]
    if not entries:
        known = sorted({t for e in registry.discover() if e.backend for t in getattr(e.backend, "export_targets", ())})
        raise UserError(f"--target {target}: no installed backend exports it (targets: {', '.join(known) or 'none'})")
    manifest = entries[0].backend.export(
        target, load_model(model), out, precision=precision, batch=batch, chunk=chunk, context=context, check=check
    )
    print(json.dumps(manifest, indent=2))
