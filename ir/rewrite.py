"""Graph rewrites as tables of (pattern, replace, guard) rules for a small matcher (as tinygrad's; docs/passes.md). Not
`torch.fx.subgraph_rewriter`: its patterns are traced, one per spelling, and Dynamo spells one op many ways."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from .trace import Trace, node_value


class Call:
    """A call to one of `targets` whose arguments, named by `params` in signature order (a last `"*rest"` takes the
    rest; the first may be `self=`), match `args`; `bind` names the call's node (docs/passes.md)."""

    def __init__(self, targets, params: tuple[str, ...], bind: Optional[str] = None, **args):
        targets = targets if isinstance(targets, tuple) else (targets,)
        self.methods = tuple(t for t in targets if isinstance(t, str))
        self.functions = tuple(t for t in targets if not isinstance(t, str)) + tuple(
            getattr(owner, t) for t in self.methods for owner in (torch, torch.Tensor) if hasattr(owner, t))
        self.names, self.bind, self.args = [p.lstrip("*") for p in params], bind, args
        self.fixed = len(params) - (bool(params) and params[-1].startswith("*"))  # not "*rest"

    def __or__(self, other) -> Either:
        return Either((self, other))

    def arguments(self, node: fx.Node) -> Optional[dict[str, Any]]:
        """`node`'s arguments by parameter name; None if it is not such a call."""
        if not (node.op == "call_method" and node.target in self.methods
                or node.op == "call_function" and node.target in self.functions):
            return None
        names, fixed = self.names, self.fixed
        if len(node.args) > fixed == len(names):  # more positional arguments than parameters
            return None
        found = dict(zip(names, node.args[:fixed]))
        if len(node.args) > fixed:
            found[names[-1]] = tuple(node.args[fixed:])
        kwargs = {names[0] if k == "self" and names else k: v for k, v in node.kwargs.items()}
        return {**found, **kwargs} if set(kwargs) <= set(names) - set(found) else None


class Either(tuple):
    """Patterns of which the first that matches is taken (`Call | Call`)."""


class Match(dict):
    """What a pattern matched at `root`: names it bound (this dict), the calls (`nodes`, root first); always true."""

    def __init__(self, root: fx.Node, bound=(), nodes=()):
        super().__init__(bound)
        self.root, self.nodes = root, list(nodes)

    def __bool__(self) -> bool:
        return True

    def value(self, name: str) -> Any:
        """The fake value of the node bound to `name`; None if no node is."""
        return node_value(self[name]) if isinstance(self.get(name), fx.Node) else None


def match(pattern: Call | Either, value: Any) -> Optional[Match]:
    """What `pattern` binds at `value` (a node), or None where it does not match."""
    m = Match(value)
    return m if _match(pattern, value, m) else None


def _match(pattern, value, m: Match) -> bool:
    if isinstance(pattern, Either):
        for option in pattern:
            if _match(option, value, trial := Match(m.root, m, m.nodes)):
                m.update(trial)
                m.nodes[:] = trial.nodes
                return True
        return False
    if isinstance(pattern, str):  # a name bound twice must bind the same value
        return m.setdefault(pattern, value) is value
    if not isinstance(pattern, Call):
        return bool(pattern(value))
    if not isinstance(value, fx.Node) or (args := pattern.arguments(value)) is None:
        return False
    m.nodes.append(value)
    return (pattern.bind is None or _match(pattern.bind, value, m)) and all(
        _match(p, args.get(name), m) for name, p in pattern.args.items())


def find(graph: fx.Graph, pattern: Call | Either, guard: Callable[[Match], bool] = lambda m: True) -> list[Match]:
    """The matches of `pattern` at the nodes of `graph` that `guard` accepts, in graph order."""
    return [m for node in graph.nodes if (m := match(pattern, node)) and guard(m)]


def rewrite(graph: fx.Graph, rules: list[tuple[Call | Either, Callable, Callable]]) -> list[Match]:
    """At each node of `graph` in order, the first `(pattern, replace, guard)` rule matching there whose `guard(match)`
    agrees calls `replace(match)`. Returns the matches replaced; added nodes are not visited, dead ones the caller's."""
    done = []
    for node in list(graph.nodes):
        for pattern, replace, guard in () if node._erased else rules:
            if (m := match(pattern, node)) and guard(m):
                replace(m)
                done.append(m)
                break
    return done


def add_call(graph: fx.Graph, target, args: tuple, value: Any) -> fx.Node:
    """A call of `target` (a str: a tensor method) with fake value `value`, under AOTAutograd's and Dynamo's keys."""
    node = graph.create_node("call_method" if isinstance(target, str) else "call_function", target, args)
    node.meta["val"] = node.meta["example_value"] = value
    return node


def derive_rewritten(trace: Trace, gm: fx.GraphModule, by: str) -> Trace:
    """`trace.derive(gm, by=by)` for `gm`, the editable copy of `trace` a pass rewrote: linted, its code made again."""
    gm.graph.lint()
    gm.recompile()
    return trace.derive(gm, by=by)
