"""What the forward saves for the backward: no fp32 value computed from one upcast half-precision one.

A loss computed in fp32 from bf16 logits (`logits.float()`, then log-softmax) can save either the
bf16 logits and two per-token reductions, recomputing the rest in the backward, or an fp32
logits-sized intermediate: twice the bytes (1 GiB instead of 0.5 GiB for 8192 tokens x 32000). The
min-cut partitioner weighs a saved value by its size times 1.1 per op between it and the backward,
so which one it keeps turns on a single op more or less on the way: a linear whose custom op returns
a list (Transformer Engine's) adds a `getitem`, and the fp32 one was saved.

This rule (`recompute_upcasts`) tags every forward value that is a full-size fp32 function of one
upcast half-precision value for recomputation, on the joint graph; the partitioner then saves the
half-precision value or something smaller (a reduction) instead.

A second rule (`recompute_fp8_casts`) tags fp8 casts made in the graph (and their byte views and
transposes) the same way: a cast the backward reads (TE's linear casts its x and W again there) is
then made in the backward from what the forward keeps anyway, never kept from forward to backward.
Without it the partitioner prefers keeping the fp8 copy of a weight, half the bytes of the weight it
is cast from, though the weight itself is kept for free (it is a parameter).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ir import is_random, node_value, output_ancestors

aten, prims = torch.ops.aten, torch.ops.prims
_HALF = (torch.bfloat16, torch.float16)
_UPCASTS = (aten._to_copy.default, prims.convert_element_type.default)
_COPIES = (aten.clone.default, aten._unsafe_view.default)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def recompute_upcasts(joint: fx.GraphModule, num_fwd_outputs: int) -> int:
    """Tags the fp32 values derived from upcast half-precision ones for recomputation; returns how
    many were tagged.

    A value counts as derived when its full-size inputs all derive from one upcast (others may be
    scalars or smaller, broadcast tensors: `x - amax`), so recomputing it needs nothing big besides
    the half-precision source. Left alone: the forward's outputs (the user's results, buffers the
    forward updates), values already tagged, random ops, and graphs with `torch.utils.checkpoint`
    regions (their boundaries are the user's choice)."""
    forward = output_ancestors(joint, num_fwd_outputs)
    root: dict[fx.Node, fx.Node] = {}  # derived node -> the upcast it is a full-size function of
    for node in joint.graph.nodes:
        if node not in forward or node.op != "call_function" or "recompute" in node.meta:
            continue
        value = node_value(node)
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or is_random(node):
            continue
        if node.target in _UPCASTS:
            source = node_value(node.args[0])
            if isinstance(source, torch.Tensor) and source.dtype in _HALF:
                root[node] = node
            continue
        if _elementwise_or_layout(node.target):
            upcast = _single_root(node, value, root)
            if upcast is not None:
                root[node] = upcast
    return _tag(joint, num_fwd_outputs, root)


def recompute_fp8_casts(joint: fx.GraphModule, num_fwd_outputs: int) -> int:
    """Tags each fp8 value computed in the graph, and the byte views, transposes and copies made of
    one, for recomputation; returns how many were tagged. Left alone as in `recompute_upcasts`: the
    forward's outputs, values already tagged, graphs with `torch.utils.checkpoint` regions."""
    derived = set()
    for node in joint.graph.nodes:
        value = node_value(node)
        if node.op != "call_function" or "recompute" in node.meta or not isinstance(value, torch.Tensor):
            continue
        layout = isinstance(node.target, torch._ops.OpOverload) and (node.target.is_view or node.target in _COPIES)
        if value.dtype in _FP8 or (layout and any(a in derived for a in node.all_input_nodes)):
            derived.add(node)
    return _tag(joint, num_fwd_outputs, derived)


def _tag(joint: fx.GraphModule, num_fwd_outputs: int, nodes) -> int:
    """Tags `nodes` but the forward's outputs for recomputation, unless the graph has
    `torch.utils.checkpoint` regions (their boundaries are the user's choice); how many it tagged."""
    if any("ac_graph_id" in n.meta for n in joint.graph.nodes):
        return 0
    output = joint.graph.output_node()
    returned = {a for a in output.args[0][:num_fwd_outputs] if isinstance(a, fx.Node)}
    tagged = [n for n in nodes if n not in returned]
    for node in tagged:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return len(tagged)


def _single_root(node: fx.Node, value: torch.Tensor, root: dict) -> fx.Node | None:
    """The upcast every full-size tensor input of `node` derives from, or None (none does, two do,
    an input as large as the output is not derived, or sizes are not known to compare)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    roots = set()
    for a in node.all_input_nodes:
        v = node_value(a)
        if not isinstance(v, torch.Tensor):
            continue
        if a in root:
            if not statically_known_true(v.numel() == value.numel()):
                return None
            roots.add(root[a])
        elif not statically_known_true(v.numel() < value.numel()):
            return None
    return roots.pop() if len(roots) == 1 else None


def _elementwise_or_layout(target) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in target.tags or target.is_view or target in _COPIES

