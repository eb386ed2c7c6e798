"""CUDA graphs for compiled stages (`pipeline.jit(..., cuda_graphs=True)`).

A stage runs one region after another, each on its executor; on a GPU fast enough, the CPU cannot
launch the kernels as quickly as they finish (Python in each executor, TE's quantizers, Inductor's
wrappers) and the GPU waits. Recording the whole stage, all regions and executors, as one CUDA graph
and replaying it costs the CPU one launch per stage.

This reuses torch.compile's "reduce-overhead" machinery (`torch._inductor.cudagraph_trees`): the
first call of a stage runs normally (warm-up: Triton autotuning, TE's and cuBLAS's lazy state), the
next records, later calls replay; parameters and saved activations stay where they are, other inputs
are copied into the graph's own buffers; forward and backward share one memory pool. Its rules are
torch.compile's: an output of a replay is overwritten by the next replay of that stage (keep a value
across steps with `.clone()` or `.item()`), and a new input shape records a new graph.

A stage that cannot be recorded (inputs off the GPU, a mutated input, dynamic shapes, an executor
whose kernels cannot be captured) runs as before, and the reason is recorded
(`pipeline.compile_stats(model).cuda_graphs`).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from ir import Trace


def why_not_recordable(trace: Trace, example_inputs: Sequence, executors) -> Optional[str]:
    """None when the stage can be recorded as a CUDA graph, else the reason it cannot."""
    devices = {t.device for t in example_inputs if isinstance(t, torch.Tensor)}
    if not torch.cuda.is_available() or not devices or any(d.type != "cuda" for d in devices):
        return f"inputs on {sorted(str(d) for d in devices) or 'no device'}: CUDA graphs need every input on the GPU"
    if len(devices) > 1:
        return f"inputs on several GPUs {sorted(str(d) for d in devices)}"
    if any(isinstance(v, torch.SymInt) for v in example_inputs) or any(
            isinstance(t, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in t.shape) for t in example_inputs):
        return "dynamic shapes (each size would record its own graph); use dynamic=False"
    unsafe = sorted(e.name for e in executors if not e.cuda_graphs_safe)
    if unsafe:
        return f"executor(s) {unsafe} launch kernels that a CUDA graph cannot capture"
    mutated = _mutated_inputs(trace.module)
    if mutated:
        return f"the stage writes into its inputs {mutated[:3]}"
    return None


def record_stage(fn: Callable, trace: Trace, example_inputs: Sequence, *, stage: str) -> Callable:
    """`fn` (a boxed stage running `trace`: takes the argument list and empties it) recorded and
    replayed through cudagraph trees."""
    from torch._inductor.cudagraph_trees import cudagraphify_impl
    from torch._inductor.cudagraph_utils import get_placeholder_info
    device = next(t.device for t in example_inputs if isinstance(t, torch.Tensor))
    graph = trace.module.graph
    run = cudagraphify_impl(fn, list(example_inputs), static_inputs(trace, stage), device_index=device.index or 0,
                            is_backward=stage == "backward", is_inference=stage == "inference",
                            stack_traces=[None] * len(trace.output_values()),  # per output, for its error messages
                            placeholders=tuple(get_placeholder_info(graph)))
    run._boxed_call = True  # AOTAutograd hands it the argument list, which it empties
    return run


def static_inputs(trace: Trace, stage: str) -> list[int]:
    """Inputs at the same address on every call: parameters and buffers; in a backward, everything
    but the tangents (the saved activations come from the recorded forward)."""
    if stage == "backward":
        return [i for i, s in enumerate(trace.inputs) if s.kind != "tangent"]
    return [i for i, s in enumerate(trace.inputs) if s.kind in ("parameter", "buffer")]


def _mutated_inputs(gm: fx.GraphModule) -> list[str]:
    placeholders = {n for n in gm.graph.nodes if n.op == "placeholder"}
    out = []
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for arg, value in zip(schema.arguments, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write and value in placeholders:
                out.append(value.name)
    return out
