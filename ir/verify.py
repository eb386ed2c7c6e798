"""The verifier: checks a trace is well formed before anyone runs or transforms it."""

import torch
import torch.fx as fx

from .trace import Trace


class TraceError(ValueError):
    """A trace is malformed; the message names the trace, the node and what is wrong."""


def verify(trace: Trace) -> Trace:
    """Returns `trace`, checked: topologically ordered, values with metadata, uses of its own nodes, specs matching."""
    where = f"trace {trace.name!r}"
    try:
        trace.graph.lint()
    except Exception as e:  # fx's lint reports dangling uses and bad ordering
        raise TraceError(f"{where}: {e}") from e
    seen: set[fx.Node] = set()
    for node in trace.graph.nodes:
        for used in node.all_input_nodes:
            if used.graph is not trace.graph:
                raise TraceError(f"{where}: node {node.name!r} uses {used.name!r} from another graph")
            if used not in seen:
                raise TraceError(f"{where}: node {node.name!r} uses {used.name!r} before it is defined")
        if node.op not in ("output", "get_attr") and node.users and not node.meta.keys() & {"val", "example_value"} \
                and node.target is not torch.amp.autocast_mode._enter_autocast:  # Dynamo's: yields a context, no value
            raise TraceError(f"{where}: node {node.name!r} ({node.format_node()}) has no shape/dtype "
                             f"metadata (meta['val']); passes must set it on the nodes they create")
        seen.add(node)
    if len(trace.inputs) != (n_in := len(trace.placeholders())):
        raise TraceError(f"{where}: {len(trace.inputs)} input specs for {n_in} placeholders")
    for i, (spec, node) in enumerate(zip(trace.inputs, trace.placeholders())):
        if spec.name != node.name:  # the caller passes its arguments by position
            raise TraceError(f"{where}: input {i} is placeholder {node.name!r}, its spec names {spec.name!r}: a pass "
                             f"reordered or renamed the inputs (keep placeholders in order; a new one goes last)")
    if trace.outputs and len(trace.outputs) != (n_out := len(trace.output_values())):
        raise TraceError(f"{where}: {len(trace.outputs)} output specs for {n_out} outputs")
    return trace
