"""Chat templates rendered with bounds: jinja2's immutable sandbox, a size limit on what a template can build, and a
time limit that stops a runaway loop in whichever thread renders.

A template comes with the model file, so it is untrusted code: `range` is already capped by the sandbox, but nested
loops, `'x' * 2000000000` or `10 ** 10 ** 9` would still hang the loader or exhaust memory. Sequence repetition
and joining, powers and padding filters are checked before they allocate; loops are stopped by a per-thread trace
function that looks at the clock on each line of template code (the compiled template's frames only, so the cost
stays small).
"""

from __future__ import annotations

import json
import math
import sys
import time
from datetime import datetime
from typing import Any

from flashnext.core.errors import UserError

MAX_SECONDS = 2.0  # real chat templates render in milliseconds
MAX_CHARS = 4 * 1024 * 1024  # output and any one string or list a template builds
_TEMPLATE_FILE = "<template>"  # jinja2's file name for code compiled from a string


class TemplateLimit(Exception):
    """A template ran past a bound; turned into a UserError naming the model."""


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _check_size(n: float, what: str) -> None:
    if n > MAX_CHARS:
        raise TemplateLimit(f"{what} would be {n:.3g} long, over the limit of {MAX_CHARS}")


def _bounded_environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                _check_size(len(left) + len(right), "a joined sequence")
            elif operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        _check_size(len(seq) * n, "a repeated sequence")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                _check_size(right * math.log2(abs(left)) / 8, "a power")
            return super().call_binop(context, operator, left, right)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    for name in ("center", "indent"):
        env.filters[name] = _width_bounded(env.filters[name])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _width_bounded(jinja_filter):
    def bounded(value, width=80, *args, **kwargs):
        if isinstance(width, int):
            _check_size(width * max(1, str(value).count("\n") + 1), "a padded string")
        return jinja_filter(value, width, *args, **kwargs)

    return bounded


def _bounded_join(join):
    def bounded(parts):
        parts = tuple(parts)
        _check_size(sum(len(p) if isinstance(p, str) else 0 for p in parts), "a joined string")
        return join(parts)

    return bounded


def compile_template(text: str, source: str):
    from jinja2 import runtime

    try:
        template = _bounded_environment().from_string(text)
    except Exception as exc:  # jinja2.TemplateSyntaxError, or RecursionError for absurd nesting
        raise UserError(f"{source}: the chat template does not parse ({str(exc)[:160]}); fix or remove it") from None
    # `~` compiles to a call of these two names in the template's own module namespace; no sandbox hook sees it.
    namespace = template.root_render_func.__globals__
    namespace["str_join"] = _bounded_join(runtime.str_join)
    namespace["markup_join"] = _bounded_join(runtime.markup_join)
    return template


def render(template, source: str, **context: Any) -> str:
    """The template's output; UserError if it fails, runs past MAX_SECONDS or builds past MAX_CHARS."""
    deadline = time.monotonic() + MAX_SECONDS

    def on_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateLimit(f"it ran past {MAX_SECONDS:g} s")
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        pieces, size = [], 0
        for piece in template.generate(**context):
            size += len(piece)
            _check_size(size, "the rendered prompt")
            pieces.append(piece)
        return "".join(pieces)
    except TemplateLimit as exc:
        raise UserError(f"{source}: the chat template was stopped: {exc}; fix or remove the template") from None
    except Exception as exc:
        raise UserError(f"{source}: chat template failed on these messages: {str(exc)[:200]}") from None
    finally:
        sys.settrace(previous)
