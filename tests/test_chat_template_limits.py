"""Single C-level operations inside a chat template (no template line runs while they do, so the clock cannot stop
them) are refused before they allocate."""

import resource
import threading

import pytest

from flashnext.core import chat_template
from flashnext.core.errors import UserError

BIG = "{% set s = 'x' * 4000000 %}"
ONE_CALL_BOMBS = {
    "str.replace into itself": BIG + "{{ s.replace('x', s) }}",
    "replace filter": BIG + "{{ s|replace('x', s) }}",
    "ljust": "{{ 'x'.ljust(2000000000) }}",
    "zfill": "{{ '1'.zfill(2000000000) }}",
    "expandtabs": "{{ ('\t' * 4000000).expandtabs(1000) }}",
    "str.join of a repeated list": BIG + "{{ s.join(['a'] * 4000000) }}",
    "percent width": "{{ '%2000000000d' % 1 }}",
    "percent star width": "{{ '%*d' % (2000000000, 1) }}",
    "format method width": "{{ '{:>2000000000}'.format(1) }}",
    "format nested width": "{{ '{:>{w}}'.format(1, w=2000000000) }}",
    "format filter": "{{ '%2000000000s'|format('a') }}",
    "printing a list of one long string repeated": BIG + "{{ [s] * 4000000 }}",
    "string filter of a shared list": BIG + "{{ ([s] * 1000)|string|length }}",
    "join filter of lists": BIG + "{{ [[s] * 1000]|join }}",
    "concat of a shared list": BIG + "{{ 'a' ~ ([s] * 1000) }}",
    "tojson of a shared list": BIG + "{{ ([s] * 1000)|tojson }}",
    "tojson indent": "{{ (range(100000)|list)|tojson(indent=2000000000) }}",
    "batch fill": "{{ [1]|batch(2000000000, 0)|list|length }}",
    "slice count": "{{ [1]|slice(2000000000)|list|length }}",
    "wordwrap with a long wrapstring": BIG + "{{ s|wordwrap(1, wrapstring=s) }}",
    "translate": BIG + "{{ s.translate({120: s}) }}",
    "sum of lists": "{{ ([[1] * 4000000] * 4000000)|sum(start=[]) }}",
    "lipsum": "{{ lipsum(2000000000) }}",
}


@pytest.mark.parametrize("name", list(ONE_CALL_BOMBS))
def test_one_call_bomb_is_refused_before_it_allocates(name):
    template = chat_template.compile_template(ONE_CALL_BOMBS[name], "model.gguf")
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results = []

    def render():
        try:
            chat_template.render(template, "model.gguf", messages=[])
        except UserError as exc:
            results.append(str(exc))

    worker = threading.Thread(target=render)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive() and len(results) == 1, results
    assert results[0].startswith("model.gguf: ") and "\n" not in results[0]
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - usage < 200 * 1024  # KiB


def test_ordinary_uses_of_the_checked_operations_still_render():
    text = (
        "{{ 'ab'.ljust(4, '-') }}|{{ 'a-b'.replace('-', '+') }}|{{ '%3d' % 7 }}|{{ '{:>3}'.format('z') }}|"
        "{{ ', '.join(['x', 'y']) }}|{{ [1, 2, 3]|batch(2)|list|length }}|{{ {'k': [1, 'v']}|tojson(indent=1) }}|"
        "{{ '%s-%s'|format('p', 'q') }}|{{ [[1], [2]]|sum(start=[]) }}|{{ messages[0]['content']|replace('i', 'I') }}"
    )
    template = chat_template.compile_template(text, "m")
    out = chat_template.render(template, "m", messages=[{"role": "user", "content": "hi"}])
    assert out == 'ab--|a+b|  7|  z|x, y|2|{\n "k": [\n  1,\n  "v"\n ]\n}|p-q|[1, 2]|hI'
