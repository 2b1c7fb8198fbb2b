"""`flashnext serve`: load the model, then serve the OpenAI-compatible API with uvicorn (docs/serving.md).

Every log line, uvicorn's access log included, goes to stderr: stdout stays free for what a command prints."""

import copy
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from .errors import UserError
from .threads import HELP as threads_help
from .threads import threads_text

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve(
    host: Annotated[str, typer.Option(help="Address to bind; loopback unless you mean to expose it.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    backend: Annotated[str, typer.Option(envvar="FLASHNEXT_BACKEND", help="auto or a backend name.")] = "auto",
    model: Annotated[str | None, typer.Option(envvar="FLASHNEXT_MODEL", help="Folder, .gguf file or HF id.")] = None,
    precision: Annotated[str | None, typer.Option(help="fp32, bf16, fp16, fp8-e4m3, fp8-e5m2, int4.")] = None,
    profile: Annotated[str | None, typer.Option(help="Backend profile, e.g. full or basic.")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(min=1, help="Requests running at once.")] = None,
    max_model_len: Annotated[int | None, typer.Option(min=16, help="Context length (tokens).")] = None,
    max_queue: Annotated[int, typer.Option(min=0, help="Requests waiting beyond the running ones; then 429.")] = 256,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="FLASHNEXT_API_KEY", help="Require 'Authorization: Bearer KEY' (all but /health)."),
    ] = None,
    threads: Annotated[int | None, typer.Option(min=1, help=threads_help)] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level: warning, info, debug.")] = "info",
    strict_clocks: Annotated[
        bool,
        typer.Option(
            "--strict-clocks", help="Refuse to start when the device's clocks are below their maximum under load."
        ),
    ] = False,
    batch_invariant: Annotated[
        bool | None,
        typer.Option(
            "--batch-invariant/--no-batch-invariant",
            help="Greedy output independent of the batch (fixed per-row arithmetic); default: the profile's.",
        ),
    ] = None,
    access_log: Annotated[bool, typer.Option(help="Log every request (on stderr).")] = True,
    log_config: Annotated[
        Path | None,
        typer.Option(help="A logging config file for uvicorn (.json, .yaml or .ini) instead of the stderr default."),
    ] = None,
    max_body_mib: Annotated[
        float,
        typer.Option(
            min=0.001, envvar="FLASHNEXT_MAX_BODY_MIB", help="Largest request body (MiB); larger ones get 413."
        ),
    ] = 8.0,
    tensor_parallel: Annotated[
        int | None,
        typer.Option(min=1, help="Split the model across N ranks (env FLASHNEXT_TENSOR_PARALLEL); docs/parallel.md."),
    ] = None,
):
    """Serve an OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

    The one-time work (weight expansion, graph captures) is done before the server listens."""
    import uvicorn

    from . import progress
    from .llm import LLM
    from .server import UVICORN_LIMITS, create_app

    if api_key is None:  # the option ignores an empty variable: read it here, so that an empty key is refused
        api_key = os.environ.get("FLASHNEXT_API_KEY")
    if api_key is not None and not api_key.strip():
        raise UserError("--api-key / FLASHNEXT_API_KEY is empty: give a key or leave it unset")
    if log_config is not None and not log_config.is_file():
        raise UserError(f"--log-config {log_config}: no such file; give a .json, .yaml or .ini logging config")
    if host not in LOOPBACK and api_key is None:
        print(f"warning: serving on {host} without --api-key: anyone who can reach it can use it", file=sys.stderr)
    with progress.shown():
        llm = LLM(
            model=model,
            backend=backend,
            precision=precision,
            profile=profile,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            threads=threads,
            strict_clocks=strict_clocks or None,
            tensor_parallel=tensor_parallel,
            batch_invariant=batch_invariant,
        )
        llm.warm_up()
    print(
        f"serving {llm.info.model} ({llm.info.backend} · {llm.engine.precision.name} · {llm.profile.name} · "
        f"{threads_text(llm.threads.threads)}) on http://{host}:{port}; load {llm.info.load_s:.1f} s, "
        f"warm-up {llm.warm_up_s:.1f} s",
        file=sys.stderr,
    )
    app = create_app(llm, api_key=api_key, max_queue=max_queue, max_body_mib=max_body_mib)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=5,
        log_config=str(log_config) if log_config else stderr_log_config(),
        **UVICORN_LIMITS,
    )


def stderr_log_config() -> dict:
    """uvicorn's own logging config with the access log moved from stdout to stderr."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config
