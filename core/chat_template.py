"""Chat templates rendered with bounds: jinja2's immutable sandbox, a size limit on what a template can build, and a
time limit that stops a runaway loop in whichever thread renders.

A template comes with the model file, so it is untrusted code: `range` is already capped by the sandbox, but nested
loops, `'x' * 2000000000` or `10 ** 10 ** 9` would still hang the loader or exhaust memory. Sequence repetition
and joining, powers and padding filters are checked before they allocate; loops are stopped by a per-thread trace
function that looks at the clock on each line of template code (the compiled template's frames only, so the cost
stays small).

The clock cannot stop one long C-level call (`s.replace('x', s)`, `'%999999999d' % 1`, printing a list that holds
one long string a million times), so every operation that builds text from sizes or repeats what it is given is
checked before it runs: string methods and filters that pad, repeat or substitute, `%` and `format` widths, and the
text form of containers (what `{{ x }}`, `string`, `join`, `~` and `tojson` produce), measured with an early exit.
"""

from __future__ import annotations

import json
import math
import re
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
    _text_size(value, "a JSON value")
    if indent is not None:
        _check_size(len(indent) if isinstance(indent, str) else int(indent), "a JSON indent")
        _check_size(_depth_bound(value) * (len(indent) if isinstance(indent, str) else int(indent)), "a JSON text")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _depth_bound(value: Any) -> int:
    """Items times nesting depth of a container: what an indent is written at most that many times for."""
    items, depth, level = 0, 0, [(value, 1)]
    while level:
        item, d = level.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, (list, tuple)):
            items, depth = items + len(item), max(depth, d)
            level.extend((x, d + 1) for x in item)
            _check_size(items, "a JSON value")
    return (items + 1) * depth


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _check_size(n: float, what: str) -> None:
    if n > MAX_CHARS:
        raise TemplateLimit(f"{what} would be {n:.3g} long, over the limit of {MAX_CHARS}")


def _text_size(value: Any, what: str) -> Any:
    """Checks that the text form of `value` stays within MAX_CHARS, walking containers (a shared element counts each
    time, as its text does) and stopping as soon as the bound is passed; returns the value."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
            total += 4 * len(item)
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
            total += 2 * len(item) + 2
        else:
            total += 24  # a number's text, or an object's bounded repr
        if total > MAX_CHARS:
            _check_size(total, what)
    return value


_FORMAT_NUMBER = re.compile(r"\d{7,}")  # a width or precision of a million or more


def _check_format(fmt: str, args: Any) -> None:
    """`%` and str.format widths: no number in the format, nor any number argument (`*` and nested widths), may
    exceed MAX_CHARS; the arguments' own text is bounded too."""
    for number in _FORMAT_NUMBER.findall(fmt):
        _check_size(int(number), "a formatted field")
    values = args.values() if isinstance(args, dict) else args if isinstance(args, (list, tuple)) else (args,)
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool):
            _check_size(abs(value), "a formatted field")
    _text_size(args, "a formatted value")
    _check_size(len(fmt), "a format string")


def _check_str_method(text: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """Bounds a str method call that can build a large string from small arguments; returns the arguments (an
    iterable for join materialized once)."""
    if name in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
        _check_size(args[0], f"a {name} string")
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        _check_size(len(text) + text.count("\t") * max(int(tab), 0), "an expanded string")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _check_replace(text, args[0], args[1])
    elif name == "join" and args:
        parts = tuple(args[0])
        _check_size(len(text) * len(parts), "a joined string")
        _check_size(sum(len(p) for p in parts if isinstance(p, str)), "a joined string")
        return (parts, *args[1:])
    elif name in ("format", "format_map"):
        _check_format(text, (*args, *kwargs.values()))
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        _check_size(len(text) * longest, "a translated string")
    return args


def _check_replace(text: str, old: str, new: str) -> None:
    hits = text.count(old) if old else len(text) + 1
    _check_size(len(text) + hits * (len(new) - len(old)), "a replaced string")


def _bounded_environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**", "%"})

        def call_binop(self, context, operator, left, right):
            if operator == "%" and isinstance(left, str):
                _check_format(left, right)
            elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                _check_size(len(left) + len(right), "a joined sequence")
            elif operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        _check_size(len(seq) * n, "a repeated sequence")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                _check_size(right * math.log2(abs(left)) / 8, "a power")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
            method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format in a checked function
            owner = getattr(method, "__self__", None)
            if isinstance(owner, str):
                args = _check_str_method(owner, getattr(method, "__name__", ""), args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    env = BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols"],
        finalize=lambda value: _text_size(value, "a printed value"),
    )
    for name in ("center", "indent"):
        env.filters[name] = _width_bounded(env.filters[name])
    _bound_filters(env.filters)
    del env.globals["lipsum"]  # a Python loop of any length outside the template's own lines; no template needs it
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
        _text_size(parts, "a joined string")
        return join(parts)

    return bounded


def _bound_filters(filters: dict) -> None:
    """Filters that build text or lists from a size argument, checked before they run."""
    originals = {
        name: filters[name] for name in ("batch", "slice", "replace", "wordwrap", "format", "string", "sum", "join")
    }

    def batch(value, linecount, fill_with=None):
        _check_size(int(linecount), "a batch")
        return originals["batch"](value, linecount, fill_with)

    def slice_(value, slices, fill_with=None):
        _check_size(int(slices), "a slice count")
        return originals["slice"](value, slices, fill_with)

    def replace(eval_ctx, s, old, new, count=None):
        _check_replace(str(s), str(old), str(new))
        return originals["replace"](eval_ctx, s, old, new, count)

    def wordwrap(environment, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
        _check_size(len(s) * (1 + len(wrapstring or "\n")), "a wrapped string")
        return originals["wordwrap"](environment, s, width, break_long_words, wrapstring, break_on_hyphens)

    def format_(value, *args, **kwargs):
        _check_format(str(value), kwargs or args)
        return originals["format"](value, *args, **kwargs)

    def string(value):
        return originals["string"](_text_size(value, "a string"))

    def sum_(environment, iterable, attribute=None, start=0):
        items = tuple(iterable)
        if not isinstance(start, (int, float)):
            _text_size((start, items), "a sum")
        return originals["sum"](environment, items, attribute, start)

    def join(eval_ctx, value, d="", attribute=None):
        items = tuple(value)
        _text_size(items, "a joined string")
        _check_size(len(str(d)) * len(items), "a joined string")
        return originals["join"](eval_ctx, items, d, attribute)

    for name, wrapper in (("batch", batch), ("slice", slice_), ("format", format_), ("string", string)):
        filters[name] = wrapper
    for name, wrapper in (("replace", replace), ("wordwrap", wordwrap), ("sum", sum_), ("join", join)):
        _pass_like(originals[name], wrapper)
        filters[name] = wrapper


def _pass_like(original, wrapper) -> None:
    """Marks a wrapper as taking the eval context or environment first, as jinja2 marks the filter it wraps."""
    from jinja2.utils import _PassArg

    wrapper.jinja_pass_arg = _PassArg.from_obj(original)


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
