"""Transforms: trace passes (Trace -> Trace), each declaring where in the pipeline it runs."""
from .base import STAGES, TracePass, as_pass, pass_factory, trace_pass
from .causal_attention import causal_attention
from .chain import Chain, chain
from .checkpoint import checkpoint
from .cpu_offload import cpu_offload
from .fsdp import FSDP, fsdp
from .group_linears import group_linears
from .grouped_kv_attention import grouped_kv_attention
from .materialize import Materialize, materialize
from .mixed_precision import mixed_precision
from .model_transform import ModelTransform
from .quantize import quantize
from .shift_labels import shift_labels

__all__ = ["TracePass", "pass_factory", "trace_pass", "as_pass", "STAGES", "mixed_precision", "checkpoint", "cpu_offload", "group_linears",
           "grouped_kv_attention", "causal_attention", "shift_labels",
           "ModelTransform", "chain", "Chain", "quantize", "materialize", "Materialize", "fsdp", "FSDP"]
