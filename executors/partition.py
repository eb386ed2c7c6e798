"""Groups assigned ops into cycle-free regions, one fx submodule per region. Run once per executor, in priority order:
an operator executor gets one region per op; a fusion executor's ops are grouped by *barrier depth*, how many ops of
other executors (or their regions) still lie, on the longest path, between the op and the graph's outputs. Along any
edge the depth never grows and drops at each foreign op, so no path leaves a group and comes back: every group is a
valid region and the regions form no cycle. An op joins its earliest consumer's group, unless it only feeds outputs."""

import math
import operator
from typing import Sequence

import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.passes.tools_common import stable_topological_sort

from ir import is_random

from .base import Executor
from .graph_utils import computes_nothing, op_name
from .symbol_inputs import pass_symbol_inputs


def partition(gm: fx.GraphModule, executors: Sequence[Executor]) -> list[tuple[str, str]]:
    """Moves `gm`'s assigned ops (in place) into submodules `region0`, ... in execution order: [(name, executor)]."""
    for k, ex in enumerate(executors):
        assigned = [n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get("executor") == ex.name]
        if not assigned:
            continue
        if ex.kind == "operator":
            partitions = [[n] + [u for u in n.users if u.target is operator.getitem]
                          for n in assigned if n.target is not operator.getitem]
        else:
            partitions = _by_barrier_depth(gm, set(assigned))
        if not partitions:
            continue
        position = {n: i for i, n in enumerate(gm.graph.nodes)}
        for j, nodes in enumerate(partitions):
            _fuse(gm, sorted(dict.fromkeys(nodes), key=position.__getitem__), f"_part{k}_{j}").meta["executor"] = ex.name
        stable_topological_sort(gm)  # a region's call goes after its last op; some outputs' users came earlier
    pass_symbol_inputs(gm)
    return _rename_in_order(gm)


def keep_islands_whole(gm: fx.GraphModule, executors: Sequence[Executor], fallback: str) -> None:
    """A fusible island (fusion executors' ops between library kernels and others' ops, grouped as `partition` does)
    split between fusion executors goes whole to the first taking all of it (split, the loss tail took 2.8 GiB more)."""
    fusion = {e.name: e for e in executors if e.kind == "fusion" and e.name != fallback}  # in priority order
    library = set().union(*(e.library_ops() for e in fusion.values()))
    members = {n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get("executor") in fusion
               and n.target not in library and n.target is not operator.getitem}
    members |= {n for n in gm.graph.nodes if n.target is operator.getitem and n.args[0] in members}
    for group in _by_barrier_depth(gm, members):
        ops = [n for n in group if n.target is not operator.getitem]
        computing = [n for n in ops if not computes_nothing(n.target)]  # only these split an island
        if len(owners := {n.meta["executor"] for n in computing}) < 2:
            continue
        if (whole := next((e for e in fusion.values() if all(e.claims(n) for n in ops)), None)) is None:
            continue
        for other in sorted(owners - {whole.name}):
            declined = sorted({op_name(n.target) for n in computing if not fusion[other].claims(n)})
            note = (f"{other} declined: its ops of this fusible island joined {whole.name}'s, which takes all of it"
                    + (f" ({other} does not take {', '.join(declined[:6])})" if declined else ""))
            for n in ops:
                if n.meta["executor"] == other:
                    n.meta["island"] = note
        for n in group:
            n.meta["executor"] = whole.name


def _by_barrier_depth(gm: fx.GraphModule, assigned: set) -> list[list[fx.Node]]:
    """The assigned nodes grouped by barrier depth (see the module docstring), each group in graph order."""
    def is_barrier(n: fx.Node) -> bool:  # an op of another executor, or a region made already
        return n not in assigned and (n.op == "call_module" or (
            n.op in ("call_function", "call_method") and n.target is not operator.getitem))

    depth: dict[fx.Node, int] = {}
    for node in reversed(gm.graph.nodes):
        depth[node] = max((depth[u] + is_barrier(u) for u in node.users), default=0)
    _outputs_as_early_as_possible(gm, assigned, depth, is_barrier)
    # An element of a multi-output op stays with the op (a tuple never crosses a region boundary); the
    # op's depth is at least its elements', so the edges out of the element still never climb.
    for node in gm.graph.nodes:
        if node.target is operator.getitem and node.args[0] in assigned:
            depth[node] = depth[node.args[0]]
    groups: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node in assigned:
            groups.setdefault(depth[node], []).append(node)
    return [groups[d] for d in sorted(groups, reverse=True)]


def _outputs_as_early_as_possible(gm: fx.GraphModule, assigned: set, depth: dict, is_barrier) -> None:
    """Work whose only use is a graph output (a weight gradient, a value saved for the backward), maybe through another
    executor's op whose result is only returned (a `t` feeding its weight-gradient `mm`), moves to the earliest group
    its inputs allow (the least depth among its computed inputs; with none, its users'), so the activations it reads are
    freed in their own layer, not at the stage's end. Depths only grow and never climb an edge: still cycle-free."""
    bound = set()
    for node in reversed(gm.graph.nodes):
        if node.users and node in assigned:
            if all(u in bound or u.op == "output" for u in node.users) and not is_random(node):
                bound.add(node)  # random ops keep their order: eager's draws
        elif node.users and node.op in ("call_function", "call_module") and all(
                u.op == "output" or (u in bound and computes_nothing(u.target)) for u in node.users):
            bound.add(node)  # returned, maybe through views
    earliest: dict[fx.Node, float] = {}
    for node in gm.graph.nodes:
        if node in bound and node in assigned:
            earliest[node] = min((earliest[p] if p in earliest else depth[_producer(p)] for p in node.all_input_nodes
                                  if p.op not in ("placeholder", "get_attr")), default=math.inf)
    for node in reversed(gm.graph.nodes):
        if node in earliest:
            users = [depth[u] + is_barrier(u) for u in node.users if u.op != "output"]
            depth[node] = earliest[node] if earliest[node] != math.inf else max(users, default=depth[node])


def _producer(node: fx.Node) -> fx.Node:
    """The op or region that made `node`: for an element of a multi-output op, the op."""
    return node.args[0] if node.target is operator.getitem else node


def _fuse(gm: fx.GraphModule, nodes: list[fx.Node], name: str) -> fx.Node:
    """`nodes` (in graph order) moved into submodule `name`, called after the last one. Not torch.fx's
    `fuse_by_partitions`: it checks every region for cycles (none: see above) and makes its code."""
    members, sub = set(nodes), fx.Graph()
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in members))
    bodies = [x for x in inputs if x.op == "get_attr"  # a higher-order op's body (cond's) goes in with it, not as input
              and isinstance(operator.attrgetter(x.target)(gm), fx.GraphModule)]
    inputs = [x for x in inputs if x not in bodies]
    env = {x: sub.get_attr(x.target) for x in bodies}
    env.update({x: sub.placeholder(x.name, type_expr=x.type) for x in inputs})  # in order of first use
    for x in [*bodies, *inputs]:
        env[x].meta = dict(x.meta)
    for n in nodes:
        env[n] = sub.node_copy(n, env.__getitem__)
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    sub.output(tuple(env[n] for n in outputs))
    gm.add_submodule(name, _LazyGraphModule(gm, sub, class_name=name))
    with gm.graph.inserting_after(nodes[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    call.meta["val"] = tuple(n.meta.get("val") for n in outputs)
    with gm.graph.inserting_before(call.next):
        for i, n in enumerate(outputs):
            n.replace_all_uses_with(gm.graph.call_function(operator.getitem, (call, i)), propagate_meta=True)
    for n in reversed(nodes):
        gm.graph.erase_node(n)
    for x in [b for b in bodies if not b.users]:
        gm.graph.erase_node(x)
    return call


def _rename_in_order(gm: fx.GraphModule) -> list[tuple[str, str]]:
    regions, renames = [], {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            new = f"region{len(regions)}"
            renames[new] = gm.get_submodule(node.target)
            node.target = new
            regions.append((new, node.meta["executor"]))
    for name, _ in list(gm.named_children()):
        delattr(gm, name)
    for name, sub in renames.items():
        gm.add_submodule(name, sub)
    return regions  # gm's code is regenerated by the caller, once its regions are compiled
