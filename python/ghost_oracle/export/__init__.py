"""The trace exporter: a PyTorch model, a batch and a clipper's claim in, a checked trace file
out (see `trace` for what is modelled and checked, `kinds` for the module handlers)."""
from .errors import TraceExportError
from .kinds import KINDS, Handler, Use, register_module, unregister_module
from .trace import FORMAT, UNCLAIMED, export_trace

__all__ = ["FORMAT", "KINDS", "Handler", "TraceExportError", "Use", "export_trace", "register_module", "UNCLAIMED",
           "unregister_module"]
