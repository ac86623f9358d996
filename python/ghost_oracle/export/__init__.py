"""Deprecated: the PyTorch exporter moved to `ghost_oracle.torch`. Its public names stay
importable from here for one minor version, each with a `DeprecationWarning`."""
from __future__ import annotations

import importlib
import warnings
from typing import Any

_MOVED = ("FORMAT", "KINDS", "UNCLAIMED", "Handler", "TraceExportError", "Use", "export_trace", "register_module",
          "unregister_module")

__all__ = list(_MOVED)


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(f"ghost_oracle.export.{name} is deprecated; import it from ghost_oracle.torch",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module("ghost_oracle.torch"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
