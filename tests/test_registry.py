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
    "versions_plugin": """
        from flashnext.core.backend import Backend, Probe
        from flashnext.core.engine.runner import ModelRunner
        from flashnext.core.hookspecs import hookimpl

        class Legacy(Backend):  # written against the first contract: a features dict, no version
            name = "legacy"
            precisions = ("fp32",)
            features = {"chunked_prefill": True, "spec_decode": True, "fp8_kv_cache": False, "turbo": True}
            def probe(self):
                return Probe(True, 5.0, "old but fine")

        class OldRunner(Legacy):
            name = "oldrunner"
            def runner_class(self, profile):
                return ModelRunner

        class Future(Backend):
            name = "future"
            api_version = 99
            def probe(self):
                raise AssertionError("a refused plugin is never probed")

        @hookimpl
        def register_backends(register):
            register(Legacy())
            register(OldRunner())
            register(Future())
    """,
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


def test_a_first_contract_plugin_keeps_working_with_its_features_mapped(third_party):
    legacy = by_name(registry.discover())["legacy"]
    assert legacy.probe.available and legacy.error is None
    caps = legacy.backend.capabilities
    assert caps.chunked_prefill and caps.drafters == ("ngram", "mtp") and not caps.cuda_graphs
    assert "fp8-e4m3" not in caps.kv_dtypes and "bf16" in caps.kv_dtypes
    features = legacy.as_json()["features"]
    assert features["chunked_prefill"] and features["spec_decode"] and features["turbo"]
    assert not features["fp8_kv_cache"] and legacy.as_json()["api_version"] == 1


def test_plugins_of_an_incompatible_contract_are_listed_as_refused_with_one_line(third_party):
    entries = by_name(registry.discover())
    old, future = entries["oldrunner"], entries["future"]
    assert not old.probe.available and not future.probe.available
    assert old.probe.reason.startswith("written for plugin API 1; API 2 changed its runner: ")
    assert "StepInput" in old.probe.reason and "\n" not in old.probe.reason
    assert future.probe.reason == "written for plugin API 99, newer than this flashnext's API 2: upgrade flashnext"
    assert future.as_json()["available"] is False and future.as_json()["error"] == future.probe.reason
    with pytest.raises(UserError, match="'future' is not available here: written for plugin API 99"):
        registry.select(list(entries.values()), "future")


def test_in_tree_features_json_is_derived_from_the_typed_capabilities():
    from flashnext.plugins.cpu import CpuBackend
    from flashnext.plugins.cuda import CudaBackend

    cpu, cuda = CpuBackend().features, CudaBackend().features
    assert cpu == {
        "cuda_graphs": False,
        "chunked_prefill": True,
        "prefix_caching": True,
        "spec_decode": True,
        "fp8_kv_cache": True,
        "static_shapes": False,
        "unified_memory": True,
    }
    assert cuda["cuda_graphs"] and cuda["spec_decode"] and cuda["int4_weights"] and not cuda["unified_memory"]


def test_a_features_dict_built_from_a_parents_features_maps_back_to_its_capabilities():
    """A plugin that extends an in-tree backend's flags as a dict (read on the class) keeps that backend's
    capabilities and adds its own flags."""
    from flashnext.plugins.cpu import CpuBackend

    class Derived(CpuBackend):
        features = CpuBackend.features | {"own_attention": True}

    caps = Derived.capabilities
    assert caps.unified_memory and caps.chunked_prefill and caps.drafters == ("ngram", "mtp")
    assert Derived().features == CpuBackend().features | {"own_attention": True}
