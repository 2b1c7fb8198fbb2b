"""`flashnext` command line (flags and JSON shapes: docs/cli.md).

This module and the cli_* modules it registers import only typer and the standard library at their top: `--help`,
`--version` and usage errors answer without loading torch. Each command imports the engine, server or suite it
needs inside its body.
"""

import functools
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Annotated

import typer

from .cli_conformance import conformance
from .cli_export import export
from .cli_serve import serve
from .errors import FlashnextError
from .threads import HELP as THREADS_HELP
from .threads import threads_text

TENSOR_PARALLEL_HELP = (
    "Split the model across N ranks (env FLASHNEXT_TENSOR_PARALLEL); flashnext starts them, or joins torchrun's."
)
WARM_UP_HELP = "Do the one-time work (weight expansion, graph captures) before the first request; timed as warm_up_s."

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Run LLMs fast on whatever accelerator is here.")
state = {"debug": False}


def _print_version(value: bool):
    if value:
        from . import __version__

        print(f"flashnext {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
):
    state["debug"] = debug


def friendly_errors(command):
    """One line on stderr and the contract's exit code instead of a traceback (unless --debug)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except FlashnextError as exc:
            _fail(str(exc), exc.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except typer.Exit:
            raise
        except Exception as exc:  # a bug of ours, or the device out of memory: still one line, --debug for more
            _fail(_out_of_memory(exc) or f"internal error: {exc!r} (rerun with --debug for the traceback)", 1)

    return wrapper


def _out_of_memory(exc: Exception) -> str | None:
    """What to lower when the device ran out of memory past the weights check (the KV cache, a capture, a large
    prefill): torch's allocator raises OutOfMemoryError, the driver a plain "CUDA error: out of memory" (a stream
    or graph on a nearly full device)."""
    torch = sys.modules.get("torch")  # only a command that loaded torch can have run out of device memory
    if not (torch and isinstance(exc, torch.OutOfMemoryError)) and "out of memory" not in str(exc):
        return None
    asked = re.search(r"Tried to allocate ([\d.]+ \w+)", str(exc))
    detail = f" allocating {asked.group(1)}" if asked else ""
    return (
        f"out of device memory{detail}; lower --max-model-len, FLASHNEXT_MAX_NUM_SEQS or "
        "FLASHNEXT_MEMORY_UTILIZATION, or use a smaller --precision"
    )


def _fail(message: str, code: int):
    if state["debug"]:
        traceback.print_exc()
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


@app.command()
@friendly_errors
def backends(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    explain: Annotated[bool, typer.Option("--explain", help="Also print each probe's facts.")] = False,
):
    """List installed backends, whether each is usable here, and why."""
    from rich.console import Console
    from rich.table import Table

    from . import registry
    from .threads import from_setting

    entries = registry.discover()
    if as_json:
        print(json.dumps([e.as_json() for e in entries], indent=2))
        return
    table = Table("backend", "available", "score", "precisions", "origin")
    table.add_column("reason", overflow="fold")  # a URL in a reason folds instead of losing its end
    for e in entries:  # precisions space-separated: a narrow terminal wraps them instead of cutting them off
        table.add_row(
            e.name,
            "yes" if e.probe.available else "no",
            f"{e.probe.score:g}",
            " ".join(e.backend.precisions) if e.backend else "",
            f"{e.origin} ({e.entry_point})",
            e.probe.reason,
        )
    Console().print(table)
    if explain:
        for e in entries:
            print(f"{e.name}: {json.dumps(e.probe.facts)}")
            if state["debug"] and e.error_detail:
                print(e.error_detail, file=sys.stderr)
        print(f"threads: {from_setting(None).reason}")


def _read_prompt(prompt: str | None) -> str:
    """The prompt, checked before any model loads."""
    from .errors import EMPTY_PROMPT, UserError

    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    if prompt is None:
        raise UserError("no prompt: pass it as an argument or on stdin")
    if not prompt.strip():
        raise UserError(EMPTY_PROMPT)
    return prompt


def _explain(entries, chosen: str):
    for e in entries:
        verdict = "chosen" if e.name == chosen else ("available" if e.probe.available else "unavailable")
        print(f"[{verdict}] {e.name} (score {e.probe.score:g}, {e.origin}): {e.probe.reason}", file=sys.stderr)


@app.command()
@friendly_errors
def run(
    prompt: Annotated[str | None, typer.Argument(help="Prompt text; read from stdin when omitted.")] = None,
    backend: Annotated[str, typer.Option(envvar="FLASHNEXT_BACKEND", help="auto or a backend name.")] = "auto",
    model: Annotated[str | None, typer.Option(envvar="FLASHNEXT_MODEL", help="Folder, .gguf file or HF id.")] = None,
    max_tokens: Annotated[int, typer.Option(min=1)] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    top_k: Annotated[int, typer.Option(min=0)] = 0,
    seed: Annotated[int | None, typer.Option()] = None,
    precision: Annotated[str | None, typer.Option(help="fp32, bf16, fp16, fp8-e4m3, fp8-e5m2, int4.")] = None,
    profile: Annotated[str | None, typer.Option(help="Backend profile, e.g. full or basic.")] = None,
    spec: Annotated[str | None, typer.Option(help="Speculative decoding: none, ngram, mtp.")] = None,
    spec_tokens: Annotated[int | None, typer.Option(min=1)] = None,
    max_model_len: Annotated[int | None, typer.Option(min=16)] = None,
    kv_cache_dtype: Annotated[str | None, typer.Option(help="auto, fp8-e5m2, ...")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of streaming.")] = False,
    explain: Annotated[bool, typer.Option("--explain", help="Print every backend probe's verdict.")] = False,
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
    threads: Annotated[int | None, typer.Option(min=1, help=THREADS_HELP)] = None,
    warm_up: Annotated[bool, typer.Option(help=WARM_UP_HELP)] = True,
    tensor_parallel: Annotated[int | None, typer.Option(min=1, help=TENSOR_PARALLEL_HELP)] = None,
):
    """Generate a completion for PROMPT."""
    from . import progress
    from .llm import LLM

    text = _read_prompt(prompt)
    params = _sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    with progress.shown():
        llm = LLM(
            model=model,
            backend=backend,
            precision=precision,
            profile=profile,
            spec=spec,
            spec_tokens=spec_tokens,
            max_model_len=max_model_len,
            kv_cache_dtype=kv_cache_dtype,
            threads=threads,
            strict_clocks=strict_clocks or None,
            tensor_parallel=tensor_parallel,
            batch_invariant=batch_invariant,
        )
        if warm_up:
            llm.warm_up()
    if explain:
        _explain(llm.info.entries, llm.info.backend)
        print(f"threads: {llm.threads.reason}", file=sys.stderr)
        steps = llm.engine.runner.steps_explained()
        if steps:
            print(f"steps: {steps}", file=sys.stderr)
    ids = llm.encode(text, chat=chat)
    warning = llm.engine.max_tokens_notice(params.max_tokens)  # the profile's max_tokens_cap, as HTTP says it
    if warning and not as_json:
        print(f"warning: {warning}", file=sys.stderr)
    start, first, pieces = _clock(llm), None, []
    for piece, new_ids in llm.stream(ids, params):
        if new_ids and first is None:
            first = _clock(llm)
        pieces.append(piece)
        if not as_json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    seq = llm.last
    end = _clock(llm)
    report = _report(llm, seq, "".join(pieces), start, first or end, end)
    if warning:
        report["warning"] = warning
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        sys.stdout.write("\n")
        t = report["timing"]
        warm_up = f", warm-up {t['warm_up_s']:.1f} s" if t["warm_up_s"] >= 0.05 else ""
        print(
            f"[{report['backend']} · {report['precision']} · {report['profile']['name']} · "
            f"{threads_text(report['threads'])}] "
            f"{report['completion_tokens']} tokens, TTFT {t['ttft_s'] * 1000:.0f} ms, "
            f"{t['decode_tok_s']:.1f} tok/s, load {t['load_s']:.1f} s{warm_up}",
            file=sys.stderr,
        )


def _clock(llm) -> tuple[float, float]:
    """(now, the runner's one-time work so far): graph captures in the first steps are not decode speed."""
    return time.perf_counter(), llm.engine.runner.stats().warm_up_s


def _sampling(**fields):
    from pydantic import ValidationError

    from .engine.sequence import SamplingParams
    from .errors import UserError

    try:
        return SamplingParams(**fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise UserError(f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']}") from None


def _report(
    llm, seq, text: str, start: tuple[float, float], first: tuple[float, float], end: tuple[float, float]
) -> dict:
    """start / first / end: _clock at the request, its first token and its last. One-time work (warm_up_s: the
    warm-up before the request, and any inside its steps) is taken out of the time to first token and the decode
    rate, and reported on its own."""
    decode_tokens = max(len(seq.output_ids) - 1, 0)
    ttft_s = (first[0] - start[0]) - (first[1] - start[1])
    decode_s = (end[0] - first[0]) - (end[1] - first[1])
    spec = llm.engine.spec_stats()
    return {
        "text": text,
        "token_ids": seq.output_ids,
        "prompt_tokens": seq.num_prompt,
        "completion_tokens": len(seq.output_ids),
        "finish_reason": seq.finish_reason,
        "backend": llm.info.backend,
        "model": llm.info.model,
        "precision": llm.engine.precision.name,
        "profile": llm.profile.model_dump(),
        "threads": llm.threads.threads,
        "timing": {
            "load_s": round(llm.info.load_s, 4),
            "ttft_s": round(ttft_s, 4),
            "decode_tok_s": round(decode_tokens / decode_s, 2) if decode_s > 0 else 0.0,
            "warm_up_s": round(llm.warm_up_s, 4),
        },
        "spec": {"method": llm.profile.spec, **spec},
    }


@app.command()
@friendly_errors
def bench(
    backend: Annotated[str, typer.Option(help="Backend name or auto.", envvar="FLASHNEXT_BACKEND")] = "auto",
    model: Annotated[str | None, typer.Option(help="Model path or HF id (default: the embedded model).")] = None,
    shape: Annotated[str | None, typer.Option(help="Random weights of this shape: qwen3-0.6b or smollm2-135m.")] = None,
    batch_sizes: Annotated[str, typer.Option("--batch-sizes", help="Comma-separated batch sizes.")] = "1,8,64",
    prompt_len: Annotated[int, typer.Option("--prompt-len", min=1, help="Prompt tokens per request.")] = 256,
    gen_len: Annotated[int, typer.Option("--gen-len", min=1, help="Generated tokens per request.")] = 128,
    precision: Annotated[
        str | None,
        typer.Option(
            help="Weight precision (default: the backend's for the model; for --shape, the embedded model's)."
        ),
    ] = None,
    profile: Annotated[str | None, typer.Option(help="Profile name (e.g. full, basic).")] = None,
    json_path: Annotated[
        Path | None,
        typer.Option("--json", help="Write the results here (a JSON list, rewritten after each configuration)."),
    ] = None,
    threads: Annotated[int | None, typer.Option(min=1, help=THREADS_HELP)] = None,
    tensor_parallel: Annotated[int | None, typer.Option(min=1, help=TENSOR_PARALLEL_HELP)] = None,
):
    """Measure TTFT, decode tok/s and throughput for each batch size."""
    from .cli_bench import run_bench

    run_bench(
        backend, model, shape, batch_sizes, prompt_len, gen_len, precision, profile, json_path, threads, tensor_parallel
    )


# Commands kept in modules of their own; such a module imports only typer and the standard library at its top
# (tests/test_cli_startup.py holds every command's --help to that). Adding one: an import above, a line here.
app.command()(friendly_errors(serve))
app.command()(friendly_errors(conformance))
app.command()(friendly_errors(export))


def main():
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app()


if __name__ == "__main__":
    main()
