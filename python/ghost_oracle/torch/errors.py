"""The exporter's one error type, shared with the JAX exporter (`ghost_oracle._trace.format`)."""
from .._trace.format import TraceExportError

__all__ = ["TraceExportError"]
