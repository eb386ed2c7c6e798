"""Lazy decomposition: break an op into core ATen / prims only when no listed executor claims it.

`decompose_node` traces the op's decomposition on the node's fake inputs with `make_fx`, giving a
small graph of simpler ops with full metadata, which the dispatcher splices in place of the node.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx
from torch._decomp import decomposition_table
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from ir import node_value


def decomposition_of(op):
    """The registered decomposition of an OpOverload, or None."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    fn = decomposition_table.get(op)
    if fn is None and op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
        fn = op.decompose
    return fn


def decompose_node(node: fx.Node) -> Optional[fx.GraphModule]:
    """The decomposition of `node` as a graph over its tensor/SymInt inputs, or None if it has none
    (or the decomposition declines, or only reproduces the op itself)."""
    fn = decomposition_of(node.target)
    if fn is None:
        return None
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    positions = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]
    values = [node_value(flat[i]) for i in positions]
    if any(v is None for v in values):
        return None

    def run(*inputs):
        filled = list(flat)
        for i, v in zip(positions, inputs):
            filled[i] = v
        args, kwargs = pytree.tree_unflatten(filled, spec)
        out = fn(*args, **kwargs)
        if out is NotImplemented:
            raise _Declined()
        return out

    fake_mode = _fake_mode_of(values)
    try:
        if fake_mode is not None:
            with fake_mode:
                gm = make_fx(run, tracing_mode="real")(*values)
        else:
            gm = make_fx(run, tracing_mode="fake")(*values)
    except _Declined:
        return None
    except Exception:
        return None  # a decomposition that cannot run on these inputs: keep the op whole
    if any(n.op == "call_function" and n.target is node.target for n in gm.graph.nodes):
        return None
    return gm


def splice(graph: fx.Graph, node: fx.Node, sub: fx.GraphModule) -> list[fx.Node]:
    """Replaces `node` in `graph` by the nodes of `sub`; returns the new nodes."""
    flat, _ = pytree.tree_flatten((node.args, node.kwargs))
    inputs = [a for a in flat if isinstance(a, fx.Node)]
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    value_map = dict(zip(placeholders, inputs))
    before = set(graph.nodes)
    with graph.inserting_before(node):
        result = graph.graph_copy(sub.graph, value_map)
    new_nodes = [n for n in graph.nodes if n not in before]
    if isinstance(result, (tuple, list)):
        for user in list(node.users):
            if user.op == "call_function" and user.target.__name__ == "getitem":
                user.replace_all_uses_with(result[user.args[1]])
                graph.erase_node(user)
            else:
                raise _Declined()
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)
    for n in new_nodes:
        n.meta.pop("executor", None)
    return new_nodes


def _fake_mode_of(values):
    from torch._subclasses.fake_tensor import FakeTensor
    for v in pytree.tree_leaves(values):
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return None


class _Declined(Exception):
    pass
