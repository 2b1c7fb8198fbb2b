"""Fault: declares prefix caching off, yet cached prefixes are reused (as an engine that ignores the declaration
would do): a backend whose kernels cannot attend over a cached prefix then computes wrong attention."""

from flashnext.core.engine import engine
from flashnext.core.hookspecs import hookimpl
from flashnext.plugins.cpu import CpuBackend


class BrokenPrefixcacheBackend(CpuBackend):
    name = "broken-prefixcache"
    features = CpuBackend.features | {"prefix_caching": False}


def _ignoring_the_declaration(bound_by_capabilities):
    def within(self, profile):
        return bound_by_capabilities(self, profile).model_copy(update={"prefix_caching": profile.prefix_caching})

    return within


@hookimpl
def register_backends(register):
    engine.LLMEngine._within_capabilities = _ignoring_the_declaration(engine.LLMEngine._within_capabilities)
    register(BrokenPrefixcacheBackend())
