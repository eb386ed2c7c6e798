"""Transforms: trace passes (Trace -> Trace) and, later, model-changing transforms."""
from .base import STAGES, TracePass, as_pass, trace_pass

__all__ = ["TracePass", "trace_pass", "as_pass", "STAGES"]
