"""Backend discovery: entry points, the allowlist, broken plugins listed but never fatal, auto selection."""

import textwrap
from importlib.metadata import EntryPoint

import pytest

from flashnext.core import registry
from flashnext.core.errors import UserError

PLUGINS = {
    "fast_plugin": """
        from flashnext.core.backend import Backend, Probe
        from flashnext.core.hookspecs import hookimpl

        class Fast(Backend):
            name = "fast"
            precisions = ("fp32",)
            def probe(self):
                return Probe(True, 50.0, "always fast")

        class Gone(Backend):
            name = "gone"
            def probe(self):
                return Probe(False, 0.0, "no such device")

        @hookimpl
        def register_backends(register):
            register(Fast())
            register(Gone())
    """,
    "import_boom": "raise RuntimeError('missing vendor library libboom.so')\n",
    "probe_boom": """
        from flashnext.core.backend import Backend
        from flashnext.core.hookspecs import hookimpl

        class Flaky(Backend):
            name = "flaky"
            def probe(self):
                raise OSError("driver crashed")

        @hookimpl
        def register_backends(register):
            register(Flaky())
    """,
}


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    """Our own entry points plus three third-party ones whose modules live in tmp_path."""
    for module, source in PLUGINS.items():
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    own = list(registry.entry_points(group=registry.ENTRY_POINT_GROUP))
    extra = [EntryPoint(name=m.split("_")[0], value=m, group=registry.ENTRY_POINT_GROUP) for m in PLUGINS]
    monkeypatch.setattr(registry, "entry_points", lambda group: own + extra)
    monkeypatch.delenv("FLASHNEXT_PLUGINS", raising=False)


def by_name(entries):
    return {e.name: e for e in entries}


def test_broken_plugins_are_listed_not_fatal(third_party):
    entries = by_name(registry.discover())
    assert entries["fast"].probe.available and entries["fast"].probe.score == 50.0
    assert not entries["gone"].probe.available and entries["gone"].probe.reason == "no such device"
    assert not entries["import"].probe.available and "libboom.so" in entries["import"].error
    assert not entries["flaky"].probe.available and "driver crashed" in entries["flaky"].error
    assert entries["cpu"].probe.available


def test_auto_picks_the_highest_available_score(third_party):
    assert registry.select(registry.discover(), "auto").name == "fast"


def test_empty_allowlist_hides_third_party_but_keeps_in_tree(third_party, monkeypatch):
    monkeypatch.setenv("FLASHNEXT_PLUGINS", "")
    names = set(by_name(registry.discover()))
    assert "cpu" in names and not names & {"fast", "gone", "import", "flaky"}
    assert registry.select(registry.discover(), "auto").name in {"cpu", "cuda"}


def test_allowlist_admits_only_named_plugins(third_party, monkeypatch):
    monkeypatch.setenv("FLASHNEXT_PLUGINS", "fast, probe")
    names = set(by_name(registry.discover()))
    assert {"fast", "gone", "flaky"} <= names and "import" not in names


def test_selecting_unknown_or_unavailable_backends_fails_clearly(third_party):
    entries = registry.discover()
    with pytest.raises(UserError, match="unknown backend 'warp'.*cpu"):
        registry.select(entries, "warp")
    with pytest.raises(UserError, match="'gone' is not available here: no such device"):
        registry.select(entries, "gone")


def test_json_shape_for_broken_entry(third_party):
    entry = by_name(registry.discover())["import"].as_json()
    assert entry["available"] is False and entry["precisions"] == [] and "libboom" in entry["reason"]
