"""What the forward saves for the backward (why, with the numbers: docs/passes.md, `save_policy`):
`recompute_upcasts` has a full-size fp32 function of one upcast half-precision value recomputed, so the
partitioner saves the half-precision value instead; `recompute_fp8_casts` does the same for fp8 casts."""

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
    """Tags the fp32 values derived from upcast half-precision ones for recomputation; returns how many. Derived:
    its full-size inputs all derive from one upcast (others may be smaller, broadcast: `x - amax`), or it is a view
    or copy of at least half of one that does (the shifted logits `x[:, :-1]`). Left alone: the forward's outputs,
    values already tagged, random ops, graphs with `torch.utils.checkpoint` regions (the user's choice)."""
    forward = output_ancestors(joint, num_fwd_outputs)
    root: dict[fx.Node, fx.Node] = {}  # derived node -> the upcast it is a full-size function of
    for node in joint.graph.nodes:
        if node not in forward or node.op != "call_function" or "recompute" in node.meta:
            continue
        if not isinstance(value := node_value(node), torch.Tensor) or value.dtype != torch.float32 or is_random(node):
            continue
        if node.target in _UPCASTS:
            if isinstance(source := node_value(node.args[0]), torch.Tensor) and source.dtype in _HALF:
                root[node] = node
            continue
        if _elementwise_or_layout(node.target) and (upcast := _single_root(node, value, root)) is not None:
            root[node] = upcast
    return _tag(joint, num_fwd_outputs, root)


def recompute_fp8_casts(joint: fx.GraphModule, num_fwd_outputs: int) -> int:
    """Tags each fp8 value computed in the graph, the byte views, transposes and copies made of one,
    and the copies it reads (`_copies_cast`); returns how many. Left alone as in `recompute_upcasts`."""
    derived = set()
    for node in joint.graph.nodes:
        value = node_value(node)
        if node.op != "call_function" or "recompute" in node.meta or not isinstance(value, torch.Tensor):
            continue
        if value.dtype in _FP8 or (_layout(node.target) and any(a in derived for a in node.all_input_nodes)):
            derived.add(node)
    return _tag(joint, num_fwd_outputs, derived | _copies_cast(derived))


def _copies_cast(fp8: set) -> set:
    """The views and copies the fp8 casts read (through the cast's elementwise ops, then layout ops
    only): e.g. SDPA's output made contiguous for a linear, made again from SDPA's output."""
    found, work = set(), [(a, False) for n in fp8 for a in n.all_input_nodes]
    while work:
        node, past_layout = work.pop()
        if node in found or node.op != "call_function" or "recompute" in node.meta:
            continue
        layout = _layout(node.target)
        if layout or (not past_layout and (_elementwise_or_layout(node.target) or node.target in _UPCASTS)):
            found |= {node} if layout else set()
            work += [(a, past_layout or layout) for a in node.all_input_nodes]
    return found


def _tag(joint: fx.GraphModule, num_fwd_outputs: int, nodes) -> int:
    """Tags `nodes` but forward outputs to recompute (none with checkpoint regions: the user's choice); how many."""
    if any("ac_graph_id" in n.meta for n in joint.graph.nodes):
        return 0
    returned = {a for a in joint.graph.output_node().args[0][:num_fwd_outputs] if isinstance(a, fx.Node)}
    tagged = [n for n in nodes if n not in returned]
    for node in tagged:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return len(tagged)


def _single_root(node: fx.Node, value: torch.Tensor, root: dict) -> fx.Node | None:
    """The upcast every full-size tensor input of `node` derives from (a view's or copy's input: at most twice its
    size), or None (none does, two do, an input as large as the output is not derived, or sizes are not known)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    roots = set()
    for a in node.all_input_nodes:
        if not isinstance(v := node_value(a), torch.Tensor):
            continue
        if a in root:  # a smaller view would make the partitioner save the whole half-precision tensor instead
            if not statically_known_true(v.numel() == value.numel() if not _layout(node.target)
                                         else 2 * value.numel() >= v.numel()):
                return None
            roots.add(root[a])
        elif not statically_known_true(v.numel() < value.numel()):
            return None
    return roots.pop() if len(roots) == 1 else None


def _layout(target) -> bool:
    """A view, or a copy that only changes the layout (`clone`, `_unsafe_view`)."""
    return isinstance(target, torch._ops.OpOverload) and (target.is_view or target in _COPIES)


def _elementwise_or_layout(target) -> bool:
    return _layout(target) or isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags

