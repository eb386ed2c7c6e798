"""The verifier: checks a trace is well formed before anyone runs or transforms it."""

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
        if node.op not in ("output", "get_attr") and node.users and not node.meta.keys() & {"val", "example_value"}:
            raise TraceError(f"{where}: node {node.name!r} ({node.format_node()}) has no shape/dtype "
                             f"metadata (meta['val']); passes must set it on the nodes they create")
        seen.add(node)
    if len(trace.inputs) != (n_in := len(trace.placeholders())):
        raise TraceError(f"{where}: {len(trace.inputs)} input specs for {n_in} placeholders")
    if trace.outputs and len(trace.outputs) != (n_out := len(trace.output_values())):
        raise TraceError(f"{where}: {len(trace.outputs)} output specs for {n_out} outputs")
    return trace
