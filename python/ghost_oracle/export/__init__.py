"""Deprecated: the PyTorch exporter moved to `ghost_oracle.torch`. Its public names stay
importable from here for one minor version, each with a `DeprecationWarning`."""
from __future__ import annotations

import importlib
from typing import Any

from .._deprecated import warn_renamed

_MOVED = ("FORMAT", "KINDS", "UNCLAIMED", "Handler", "TraceExportError", "Use", "export_trace", "register_module",
          "unregister_module")

__all__ = list(_MOVED)


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warn_renamed(f"ghost_oracle.export.{name}", f"ghost_oracle.torch.{name}")
        return getattr(importlib.import_module("ghost_oracle.torch"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
