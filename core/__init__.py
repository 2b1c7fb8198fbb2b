"""flashnext core: interfaces, engine, loaders. `from flashnext.core import LLM, SamplingParams`."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("flashnext")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name):
    # Lazy: `flashnext backends` should not pay for the engine's imports.
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "SamplingParams":
        from .engine.sequence import SamplingParams

        return SamplingParams
    raise AttributeError(name)
