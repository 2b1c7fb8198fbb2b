"""The plugin contract: a module named by a `flashnext.backends` entry point implements these hooks."""

import pluggy

hookspec = pluggy.HookspecMarker("flashnext")
hookimpl = pluggy.HookimplMarker("flashnext")


@hookspec
def register_backends(register):
    """Call `register(backend)` once for each Backend instance the plugin provides. Each declares the contract it
    was written for (`Backend.api_version`); one this flashnext cannot run is listed as refused, never probed."""
