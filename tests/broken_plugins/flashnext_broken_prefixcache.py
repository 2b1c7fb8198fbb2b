"""Fault: declares prefix caching off, yet cached prefixes are reused (as an engine that ignores the declaration
would do): a backend whose kernels cannot attend over a cached prefix then computes wrong attention."""

from flashnext.core.engine import engine
from flashnext.core.hookspecs import hookimpl
from flashnext.plugins.cpu import CpuBackend


class BrokenPrefixcacheBackend(CpuBackend):
    name = "broken-prefixcache"
    features = CpuBackend.features | {"prefix_caching": False}


@hookimpl
def register_backends(register):
    engine.declares = lambda backend, feature: feature == "prefix_caching" or bool(backend.features.get(feature))
    register(BrokenPrefixcacheBackend())
