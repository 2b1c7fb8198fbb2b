"""Backend discovery through entry points and pluggy; a broken plugin is listed, never fatal."""

import os
import traceback
from dataclasses import dataclass, field
from importlib.metadata import entry_points

import pluggy

from . import hookspecs
from .backend import Backend, Probe, incompatibility
from .errors import UserError

ENTRY_POINT_GROUP = "flashnext.backends"
OWN_DISTRIBUTION = "flashnext"


@dataclass
class BackendEntry:
    name: str
    origin: str  # "distribution version"
    backend: Backend | None
    probe: Probe
    error: str | None = None
    error_detail: str = field(default="", repr=False)  # traceback, shown with --debug
    entry_point: str = ""  # the entry point's name: with the distribution, what FLASHNEXT_PLUGINS matches

    def as_json(self) -> dict:
        b = self.backend
        return {
            "name": self.name,
            "available": self.probe.available,
            "score": self.probe.score,
            "reason": self.probe.reason,
            "origin": self.origin,
            "entry_point": self.entry_point,
            "precisions": list(b.precisions) if b else [],
            "features": b.capabilities.features() if b else {},
            "api_version": (b.api_version or 1) if b else None,
            "default_profile": b.default_profile if b else None,
            "facts": self.probe.facts,
            "error": self.error,
        }


def _allowlist() -> set[str] | None:
    raw = os.environ.get("FLASHNEXT_PLUGINS")
    return None if raw is None else {n.strip() for n in raw.split(",") if n.strip()}


def discover() -> list[BackendEntry]:
    """Every backend registered under the entry-point group, probed. Third-party ones obey FLASHNEXT_PLUGINS, which
    names entry points or distributions (both shown by `flashnext backends`): the allowlist is applied before a
    plugin is imported, so the backend names its code registers are not known yet."""
    allow = _allowlist()
    entries: list[BackendEntry] = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = ep.dist.name if ep.dist else "unknown"
        origin = f"{dist} {ep.dist.version}" if ep.dist else dist
        if dist != OWN_DISTRIBUTION and allow is not None and not allow & {ep.name, dist}:
            continue
        for entry in _load(ep, origin):
            entry.entry_point = ep.name
            entries.append(entry)
    return entries


def _load(ep, origin: str) -> list[BackendEntry]:
    pm = pluggy.PluginManager("flashnext")
    pm.add_hookspecs(hookspecs)
    found: list[Backend] = []
    try:
        pm.register(ep.load(), name=ep.name)
        pm.hook.register_backends(register=found.append)
    except Exception as exc:  # a plugin's bug must not break the CLI
        return [_failed(ep.name, origin, None, f"plugin failed to load: {exc!r}")]
    return [_probed(b, origin) for b in found]


def _probed(backend: Backend, origin: str) -> BackendEntry:
    refused = incompatibility(backend)
    if refused:  # never probed: its code may not run against this contract
        return BackendEntry(backend.name, origin, backend, Probe(False, 0.0, refused), error=refused)
    try:
        probe = backend.probe()
    except Exception as exc:
        return _failed(backend.name, origin, backend, f"probe raised: {exc!r}")
    return BackendEntry(backend.name, origin, backend, probe)


def _failed(name, origin, backend, message) -> BackendEntry:
    probe = Probe(available=False, score=0.0, reason=message)
    return BackendEntry(name, origin, backend, probe, error=message, error_detail=traceback.format_exc())


def select(entries: list[BackendEntry], name: str) -> BackendEntry:
    """The named backend, or for 'auto' the available one with the highest score."""
    if name == "auto":
        usable = [e for e in entries if e.probe.available]
        if not usable:
            raise UserError("no backend is available here; run `flashnext backends --explain` to see why")
        return max(usable, key=lambda e: e.probe.score)
    for entry in entries:
        if entry.name == name:
            if not entry.probe.available:
                raise UserError(f"backend '{name}' is not available here: {entry.probe.reason}")
            return entry
    known = ", ".join(e.name for e in entries) or "none"
    raise UserError(f"unknown backend '{name}': installed backends are {known} (or use 'auto')")
