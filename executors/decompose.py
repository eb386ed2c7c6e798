"""Decomposition node by node: an op split into simpler ops where it stands, the rest of the graph untouched: one op
traced on its fake inputs (`decompose_node`), or every op a table covers (`decompose_graph`, for Inductor's regions)."""

import contextlib
import copy
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
    return decomposition_table.get(op) or (op.decompose if _is_composite(op) else None)


def _is_composite(op) -> bool:
    """Whether the op is written in other ops (CompositeImplicitAutograd): make_fx breaks it up."""
    return op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)


def decompose_node(node: fx.Node, table: Optional[dict] = None) -> Optional[fx.GraphModule]:
    """`node`'s decomposition as a graph over its tensor/SymInt inputs; None if it has none, declines or reproduces the
    op. With `table`: traced through it recursively (as `make_fx` does); else its registered one, one level."""
    if (fn := node.target if table is not None else decomposition_of(node.target)) is None:
        return None
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    values = [node_value(a) for a in flat if isinstance(a, fx.Node)]
    if any(v is None for v in values):
        return None

    def run(*inputs):
        given = iter(inputs)  # in the order of `values`: one per node argument
        args, kwargs = pytree.tree_unflatten([next(given) if isinstance(a, fx.Node) else a for a in flat], spec)
        if (out := fn(*args, **kwargs)) is NotImplemented:
            raise _Declined()
        return out

    fake_mode = _fake_mode_of(values)  # traced in the inputs' own fake mode, else in a new one
    try:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            gm = make_fx(run, decomposition_table=table, tracing_mode="fake" if fake_mode is None else "real")(*values)
    except _Declined:
        return None
    except Exception:
        if table is not None:  # decompose_graph re-traces the whole graph, which decides
            raise
        return None  # a decomposition that cannot run on these inputs: keep the op whole
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    if table is not None:  # declined: the op itself, alone (a decomposition may re-emit it upcast)
        return None if len(calls) == 1 and calls[0].target is node.target else gm
    return None if any(n.target is node.target for n in calls) else gm


def replace_by_traced(node: fx.Node, fn, *args) -> None:
    """Replaces `node` by the ATen ops `make_fx` traces of `fn(*args)` (node arguments as fake values); raises
    `NotDecomposable` unless they compute its metadata. Call it on an editable copy: a failure leaves it half-done."""
    promised, node.target, node.args, node.kwargs = node_value(node), fn, args, {}
    if (sub := decompose_node(node, table={})) is None:
        raise NotDecomposable(f"{getattr(fn, '__name__', fn)} traced to nothing but itself")
    _splice_with_values(node.graph, node, sub, _fake_mode_of(promised), {})


class NotDecomposable(Exception):
    """`decompose_graph` cannot decompose this graph node by node (the caller re-traces it whole)."""


def decompose_graph(gm: fx.GraphModule, table: dict) -> fx.GraphModule:
    """A copy of `gm`, each op `table` decomposes (or CompositeImplicit) replaced, traced once per signature; values
    re-derived at each splice (and its views) so fake values alias as real ones do (Inductor's passes read that)."""
    graph = copy.deepcopy(gm.graph)
    if (fake_mode := _fake_mode_of([node_value(n) for n in graph.nodes if n.op == "placeholder"])) is None:
        raise NotDecomposable("the graph's inputs carry no fake values")
    higher_order = [n.name for n in graph.nodes if n.op == "call_function"
                    and isinstance(n.target, torch._ops.HigherOrderOperator)]
    if higher_order:  # their bodies (and out_dtype, which the table decomposes) need the whole re-trace
        raise NotDecomposable(f"higher-order ops {higher_order[:3]}")
    traced, stale = {}, {}  # stale: node -> storages its users (views) may alias from before a splice: re-derived too
    for node in [n for n in graph.nodes if n.op == "call_function"]:
        if isinstance(node.target, torch._ops.OpOverload) and (node.target in table or _is_composite(node.target)):
            if (key := _signature(node)) not in traced:
                try:
                    traced[key] = decompose_node(node, table)
                except Exception as e:
                    raise NotDecomposable(f"tracing {node.target} failed: {type(e).__name__}: {e}") from e
                if traced[key] is not None and any(n.op == "get_attr" for n in traced[key].graph.nodes):
                    raise NotDecomposable(f"{node.target}'s decomposition makes tensor constants")
            if (sub := traced[key]) is not None and not _retarget(node, sub):  # retargeted: one op for another
                _splice_with_values(graph, node, sub, fake_mode, stale)
                continue
        inputs_stale = [stale[i] for i in node.all_input_nodes if i in stale]
        mine = _storages(node_value(node)) if inputs_stale else set()
        if any(mine & s for s in inputs_stale):
            node.meta = {**node.meta, "val": _fake_run(node, fake_mode)}
            stale.setdefault(node, set()).update(mine)
    return fx.GraphModule(gm, graph)


def _splice_with_values(graph: fx.Graph, node: fx.Node, sub: fx.GraphModule, fake_mode, stale: dict):
    """Splices `sub` in place of `node`, deriving each new node's value from its inputs' values."""
    promised = node_value(node)
    try:
        new_nodes, result = _inline(graph, node, sub)
    except _Declined:
        raise NotDecomposable(f"a user of {node.name}'s outputs is not an index into them") from None
    for n in new_nodes:
        if n.op == "call_function":
            n.meta = {**n.meta, "val": _fake_run(n, fake_mode)}
    got = pytree.tree_map(lambda r: node_value(r) if isinstance(r, fx.Node) else r, result)
    if not _same_metadata(got, promised):
        raise NotDecomposable(f"{node.target}'s decomposition changes its output's metadata")
    results = result if isinstance(result, (tuple, list)) else [result]
    olds = promised if isinstance(promised, (tuple, list)) else [promised]
    for r, old in zip(results, olds):
        if isinstance(r, fx.Node):
            stale.setdefault(r, set()).update(_storages(old))


def _storages(value) -> set:
    from torch.multiprocessing.reductions import StorageWeakRef
    return {StorageWeakRef(t.untyped_storage()) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)}


def _retarget(node: fx.Node, sub: fx.GraphModule) -> bool:
    """Where `sub` is one op with the node's metadata (`t` -> `permute`), the node becomes it in place; else False."""
    calls = [n for n in sub.graph.nodes if n.op == "call_function"]
    output = next(n for n in reversed(sub.graph.nodes) if n.op == "output").args[0]
    if len(calls) != 1 or output is not calls[0] or not _same_metadata(node_value(calls[0]), node_value(node)):
        return False
    value_map = _placeholders_to_inputs(node, sub)
    node.target = calls[0].target
    node.args, node.kwargs = fx.map_arg((calls[0].args, calls[0].kwargs), value_map.__getitem__)
    return True


def _signature(node: fx.Node) -> tuple:
    """What a traced decomposition depends on: the op, each input's metadata, which argument slots share an input
    (tracing `lerp(x, x, w)` binds both to one placeholder), and constants (floats by repr: 0.0 and -0.0 hash alike)."""
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    key: list = [node.target, str(spec)]
    first_slot: dict = {}
    for a in flat:
        if isinstance(a, fx.Node):
            v = node_value(a)
            if not isinstance(v, torch.Tensor) or any(not isinstance(s, int) for s in (*v.shape, *v.stride())):
                raise NotDecomposable(f"input {a.name} of {node.name} is not a tensor of static shape")
            key.append((first_slot.setdefault(a, len(first_slot)), tuple(v.shape), v.stride(), v.dtype,
                        v.device, v.storage_offset(), v.requires_grad))
        elif isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise NotDecomposable(f"{node.name} takes a symbolic size")
        elif isinstance(a, (int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)):
            key.append((type(a), a))
        else:
            key.append((type(a), repr(a)))
    return tuple(key)


def _fake_run(node: fx.Node, fake_mode):
    args, kwargs = pytree.tree_map(lambda a: node_value(a) if isinstance(a, fx.Node) else a, (node.args, node.kwargs))
    with fake_mode:
        return node.target(*args, **kwargs)


def _same_metadata(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_metadata(x, y) for x, y in zip(a, b))
    return type(a) is type(b)


def splice(graph: fx.Graph, node: fx.Node, sub: fx.GraphModule) -> list[fx.Node]:
    """Replaces `node` in `graph` by the nodes of `sub`; returns the new nodes."""
    new_nodes, _ = _inline(graph, node, sub)
    for n in new_nodes:
        n.meta.pop("executor", None)
    return new_nodes


def _inline(graph: fx.Graph, node: fx.Node, sub: fx.GraphModule) -> tuple[list[fx.Node], object]:
    """Replaces `node` in `graph` by the nodes of `sub`; returns the new nodes and the value(s) for its result."""
    value_map = _placeholders_to_inputs(node, sub)
    with graph.inserting_before(node):
        result = graph.graph_copy(sub.graph, value_map)  # fills value_map: sub's node -> its copy
    new_nodes = [value_map[n] for n in sub.graph.nodes if n.op not in ("placeholder", "output")]
    if isinstance(result, (tuple, list)):
        for user in list(node.users):
            if user.op != "call_function" or user.target.__name__ != "getitem":
                raise _Declined()
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)
    return new_nodes, result


def _placeholders_to_inputs(node: fx.Node, sub: fx.GraphModule) -> dict:
    """`sub`'s placeholders (traced from `node`'s node arguments, in order) -> those arguments."""
    flat, _ = pytree.tree_flatten((node.args, node.kwargs))
    return dict(zip((n for n in sub.graph.nodes if n.op == "placeholder"), (a for a in flat if isinstance(a, fx.Node))))


def _fake_mode_of(values):
    from torch._subclasses.fake_tensor import FakeTensor
    return next((v.fake_mode for v in pytree.tree_leaves(values) if isinstance(v, FakeTensor)), None)


class _Declined(Exception):
    pass
