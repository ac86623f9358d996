"""The exporter's one error type, shared with the JAX exporter (`ghost_oracle.trace_file`)."""
from ..trace_file import TraceExportError

__all__ = ["TraceExportError"]
