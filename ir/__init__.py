"""The IR: immutable functional traces over `torch.fx`, printer, interpreter, verifier; it imports no other package."""
from .trace import (InputKind, InputSpec, OutputKind, OutputSpec, Stage, Step, Trace, describe_value,
                    fake_like, is_random, node_value, output_ancestors)
from .printer import python_callable, python_globals, python_source
from .interpret import interpret
from .verify import TraceError, verify
from .region import Region
from .diagnostics import PipelineFallbackWarning, PipelineWarning, get_logger

__all__ = ["Trace", "InputSpec", "InputKind", "OutputSpec", "OutputKind", "Stage", "Step", "Region", "TraceError",
           "verify", "interpret", "python_source", "python_callable", "python_globals", "describe_value", "fake_like",
           "node_value", "is_random", "output_ancestors", "PipelineWarning", "PipelineFallbackWarning", "get_logger"]
