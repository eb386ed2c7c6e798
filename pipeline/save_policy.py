"""What the forward may save for the backward: never an fp32 copy of a half-precision value.

A loss computed in fp32 from bf16 logits (`logits.float()`, then log-softmax) can save either the
bf16 logits and two per-token reductions, recomputing the rest in the backward, or an fp32
logits-sized intermediate: twice the bytes (1 GiB instead of 0.5 GiB for 8192 tokens x 32000). The
min-cut partitioner weighs a saved value by its size times 1.1 per op between it and the backward,
so which one it keeps turns on a single op more or less on the way: a linear whose custom op returns
a list (Transformer Engine's) adds a `getitem`, and the fp32 one was saved.

This rule marks, on the joint graph, every forward value that is a full-size fp32 function of an
upcast half-precision value (the upcast, then pointwise ops, views and copies of it) as one to
recompute, with the tags activation checkpointing uses; the partitioner then saves the half-precision
value or something smaller (a reduction) instead. Values already tagged (by `checkpoint`, say) and
random ops are left alone.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ir import node_value

aten, prims = torch.ops.aten, torch.ops.prims
_HALF = (torch.bfloat16, torch.float16)
_UPCASTS = (aten._to_copy.default, prims.convert_element_type.default)
_COPIES = (aten.clone.default, aten._unsafe_view.default, aten.contiguous.default)


def recompute_upcasts(joint: fx.GraphModule, num_fwd_outputs: int) -> int:
    """Tags the fp32 values derived from upcast half-precision ones for recomputation; returns how
    many were tagged."""
    forward = _forward_nodes(joint, num_fwd_outputs)
    derived: dict[fx.Node, int] = {}  # node -> numel of the upcast value it is a full-size function of
    for node in joint.graph.nodes:
        if node not in forward or node.op != "call_function" or "recompute" in node.meta:
            continue
        value = node_value(node)
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or _is_random(node):
            continue
        if node.target in _UPCASTS:
            source = node_value(node.args[0])
            if isinstance(source, torch.Tensor) and source.dtype in _HALF:
                derived[node] = value.numel()
            continue
        sizes = [derived[a] for a in node.all_input_nodes if a in derived]
        if sizes and _elementwise_or_layout(node.target) and value.numel() >= min(sizes):
            derived[node] = min(sizes)
    for node in derived:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return len(derived)


def _forward_nodes(joint: fx.GraphModule, num_fwd_outputs: int) -> set[fx.Node]:
    output = joint.graph.output_node()
    stack = [a for a in output.args[0][:num_fwd_outputs] if isinstance(a, fx.Node)]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _elementwise_or_layout(target) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in target.tags or target.is_view or target in _COPIES


def _is_random(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags
