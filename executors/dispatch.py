"""The dispatcher: assigns each ATen op to an executor, decomposing lazily (a level at a time, where listed executors
claim every part: docs/design.md); otherwise the op stays whole on `torch`: splitting `cumsum` into a masked O(n²) sum
to fuse one `mul` of it slows it and changes its numerics for nothing. Every fallback records why."""

import dataclasses
import operator
from typing import Sequence

import torch.fx as fx

from .base import Executor
from .graph_utils import is_symbolic_glue
from .decompose import decompose_node, splice

MAX_DECOMPOSITION_DEPTH = 8


@dataclasses.dataclass
class Assignment:
    """The outcome of `assign`: how many ops each executor got, and why ops fell back."""
    decomposed: list[str] = dataclasses.field(default_factory=list)   # ops broken into parts
    fallbacks: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (op, reason)


def assign(gm: fx.GraphModule, executors: Sequence[Executor], fallback: Executor) -> Assignment:
    """Sets `node.meta["executor"]` on every op of `gm` (edited in place: pass a private copy)."""
    result = Assignment()
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is not operator.getitem:
            _assign_node(gm.graph, node, executors, fallback, result, depth=0)
    for node in gm.graph.nodes:  # a getitem runs where its producer runs
        if node.op == "call_function" and node.target is operator.getitem:
            node.meta["executor"] = node.args[0].meta.get("executor", fallback.name)
    return result


def _assign_node(graph, node, executors, fallback, result, depth) -> bool:
    """Assigns `node`; returns True when a listed executor took it or a part of it."""
    for ex in executors:
        if ex.claims(node):
            node.meta["executor"] = ex.name
            return True
    target = node.target
    name = str(target) if hasattr(target, "_schema") else getattr(target, "__name__", str(target))
    sub = decompose_node(node) if depth < MAX_DECOMPOSITION_DEPTH else None
    if sub is not None and _all_parts_claimed(sub, executors, depth + 1):
        try:
            new_nodes = splice(graph, node, sub)
        except Exception:
            new_nodes = None
        if new_nodes is not None:
            result.decomposed.append(name)
            for n in new_nodes:
                if n.op == "call_function" and n.target is not operator.getitem:
                    _assign_node(graph, n, executors, fallback, result, depth + 1)
            return True
    node.meta["executor"] = fallback.name
    listed = ", ".join(ex.name for ex in executors) or "none"
    why = "nor all parts of its decomposition" if sub is not None else "and it has no decomposition"
    result.fallbacks.append((name, f"no listed executor ({listed}) claims {name}, {why}"))
    return False


def _all_parts_claimed(sub: fx.GraphModule, executors, depth) -> bool:
    """Whether every op of a decomposition is claimed, directly or through its own decomposition."""
    for n in sub.graph.nodes:
        if (n.op != "call_function" or n.target is operator.getitem or is_symbolic_glue(n.target)
                or any(ex.claims(n) for ex in executors)):
            continue
        deeper = decompose_node(n) if depth < MAX_DECOMPOSITION_DEPTH else None
        if deeper is None or not _all_parts_claimed(deeper, executors, depth + 1):
            return False
    return True
