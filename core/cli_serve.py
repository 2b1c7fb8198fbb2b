"""`flashnext serve`: load the model, then serve the OpenAI-compatible API with uvicorn (docs/serving.md)."""

import contextlib
import os
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console

from .errors import UserError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve(
    host: Annotated[str, typer.Option(help="Address to bind; loopback unless you mean to expose it.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    backend: Annotated[str, typer.Option(envvar="FLASHNEXT_BACKEND", help="auto or a backend name.")] = "auto",
    model: Annotated[Optional[str], typer.Option(envvar="FLASHNEXT_MODEL", help="Folder, .gguf file or HF id.")] = None,
    precision: Annotated[Optional[str], typer.Option(help="fp32, bf16, fp16, fp8-e4m3, fp8-e5m2, int4.")] = None,
    profile: Annotated[Optional[str], typer.Option(help="Backend profile, e.g. full or basic.")] = None,
    max_num_seqs: Annotated[Optional[int], typer.Option(min=1, help="Requests running at once.")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(min=16, help="Context length (tokens).")] = None,
    max_queue: Annotated[int, typer.Option(min=0, help="Requests waiting beyond the running ones; then 429.")] = 256,
    api_key: Annotated[Optional[str], typer.Option(
        envvar="FLASHNEXT_API_KEY", help="Require 'Authorization: Bearer KEY' (all but /health).")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level: warning, info, debug.")] = "info",
    max_body_mib: Annotated[float, typer.Option(min=0.001, envvar="FLASHNEXT_MAX_BODY_MIB",
                                                help="Largest request body (MiB); larger ones get 413.")] = 8.0,
):
    """Serve an OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    import uvicorn

    from .llm import LLM
    from .server import UVICORN_LIMITS, create_app

    if api_key is None:  # the option ignores an empty variable: read it here, so that an empty key is refused
        api_key = os.environ.get("FLASHNEXT_API_KEY")
    if api_key is not None and not api_key.strip():
        raise UserError("--api-key / FLASHNEXT_API_KEY is empty: give a key or leave it unset")
    if host not in LOOPBACK and api_key is None:
        print(f"warning: serving on {host} without --api-key: anyone who can reach it can use it", file=sys.stderr)
    spinner = Console(stderr=True).status("loading model…", spinner="dots")
    with spinner if sys.stderr.isatty() else contextlib.nullcontext():
        llm = LLM(model=model, backend=backend, precision=precision, profile=profile, max_num_seqs=max_num_seqs,
                  max_model_len=max_model_len)
    print(f"serving {llm.info.model} ({llm.info.backend} · {llm.engine.precision.name} · {llm.profile.name})"
          f" on http://{host}:{port}", file=sys.stderr)
    app = create_app(llm, api_key=api_key, max_queue=max_queue, max_body_mib=max_body_mib)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, **UVICORN_LIMITS)

