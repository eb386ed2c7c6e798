"""`checkpoint(policy)`: activation checkpointing as `node.meta["recompute"]` tags (`torch.utils.checkpoint`'s selective
policies') on the joint graph's forward ops, which AOTAutograd's min-cut partitioner honours (docs/passes.md)."""

import operator
from typing import Callable, Union

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ir import OutputKind, Trace, is_random, output_ancestors

from .base import TracePass, pass_factory

aten = torch.ops.aten

EXPENSIVE = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution, aten._convolution,
             aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_for_cpu,
             aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
             aten._flash_attention_forward, aten._efficient_attention_forward}


def is_expensive(node: fx.Node) -> bool:
    """Matmuls, convolutions and attention: what the selective policy saves."""
    return isinstance(node.target, torch._ops.OpOverload) and node.target.overloadpacket in EXPENSIVE


@pass_factory
def checkpoint(policy: Union[str, Callable[[fx.Node], bool]] = "selective") -> TracePass:
    """A joint-graph pass choosing, per forward op, whether its output is saved or recomputed."""
    if policy == "full":
        save, recompute, label = (lambda node: False), CheckpointPolicy.MUST_RECOMPUTE, "full"
    elif policy == "selective":
        save, recompute, label = is_expensive, CheckpointPolicy.PREFER_RECOMPUTE, "selective"
    elif callable(policy):
        save, recompute, label = policy, CheckpointPolicy.PREFER_RECOMPUTE, getattr(policy, "__name__", "predicate")
    else:
        raise ValueError(f"checkpoint: policy must be 'full', 'selective' or a function node -> bool "
                         f"(True to save), got {policy!r}")
    name = f"checkpoint({label})"

    def apply(trace: Trace) -> Trace:
        gm = trace.editable()
        # saved: random draws (they would differ) and reads of an input written back after the forward (BatchNorm stats)
        written = {s.target for s in trace.outputs if s.kind == OutputKind.FORWARD_OUTPUT and s.target}
        for node in forward_ops(gm, trace):
            stale = any(a.op == "placeholder" and a.name in written for a in node.all_input_nodes)
            node.meta["recompute"] = (node.args[0].meta.get("recompute") if node.target is operator.getitem else
                                      CheckpointPolicy.MUST_SAVE if is_random(node) or stale or save(node) else recompute)
        return trace.derive(gm, by=name)

    return TracePass(apply, runs_on="joint", name=name)


def forward_ops(gm: fx.GraphModule, trace: Trace) -> list[fx.Node]:
    """The ops the forward outputs depend on (the joint trace's outputs say which are forward)."""
    forward = output_ancestors(gm, sum(1 for s in trace.outputs if s.kind == OutputKind.FORWARD_OUTPUT))
    return [n for n in gm.graph.nodes if n in forward and n.op == "call_function"]
