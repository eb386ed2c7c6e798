"""Shape symbols a graph names, and whether its inputs bind them. Code computing `2*(s48//2)` needs `s48`, bound by
compilers only from an input that *is* it (a size, stride or SymInt, not `s48-10`) or, unbacked (`u0`), by the op making
it. `check_symbols_bound` fails an unbound one at build time, not with a run-time `NameError`."""

import dataclasses
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from .trace import node_value
from .verify import TraceError

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class UnboundSymbolError(TraceError):
    """A graph refers to a shape symbol that none of its inputs binds."""


@dataclasses.dataclass(frozen=True)
class UnboundSymbol:
    """One unbound symbol, the first node that refers to it (`how`), and the op that needs it."""
    symbol: str
    node: str
    op: str
    how: str

    def __str__(self) -> str:
        return f"{self.symbol} (in {self.how} {self.node!r}, op {self.op})"


def unbound_symbols(gm: fx.GraphModule) -> list[UnboundSymbol]:
    """The symbols `gm`'s values and arguments use that no input binds, each with its first user, in graph order."""
    nodes = list(gm.graph.nodes)
    if _static(placeholders := [n for n in nodes if n.op == "placeholder"]):
        return []
    bound = set().union(*(binds(node_value(p)) for p in placeholders)) if placeholders else set()
    missing: dict[Any, UnboundSymbol] = {}

    def need(exprs, node, how, op=None):
        for expr in exprs:
            for s in expr.free_symbols - bound:
                missing.setdefault(s, UnboundSymbol(str(s), node.name, op or _op(node), how))

    for node in placeholders:  # a tensor input's own offset is not read by compiled code
        reader = next(iter(node.users), None)
        need(_exprs(node_value(node), offsets=False), node, "the value of input",
             f"{_op(reader)}, which reads it" if reader is not None else "none reads it")
    for node in nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        exprs = list(_exprs(node_value(node)))
        bound |= _introduced(node, exprs)
        need(exprs, node, "the value of node")
        literals = [a.node.expr for a in tree_leaves((node.args, node.kwargs)) if isinstance(a, _SYMBOLIC)]
        need(literals, node, "a symbolic constant (not a graph value) in the arguments of node")
    return list(missing.values())


def check_symbols_bound(gm: fx.GraphModule, where: str) -> None:
    """Raises `UnboundSymbolError` if `gm` refers to a symbol no input binds; `where` names the graph ("region 3")."""
    if problems := unbound_symbols(gm):
        inputs = [f"{p.name}: {_show(node_value(p))}" for p in gm.graph.nodes if p.op == "placeholder"]
        raise UnboundSymbolError(
            f"{where}: refers to shape symbol{'s' if len(problems) > 1 else ''} {'; '.join(map(str, problems))}, which no "
            f"input binds (inputs: {', '.join(inputs) or 'none'}); its compiled code would fail with NameError. The graph "
            f"must take each symbol as an input (a SymInt, or a tensor whose size or stride is that symbol).")


def binds(value) -> set:
    """The plain symbols an input with this (fake) value binds: its sizes and strides, or itself if a SymInt."""
    import sympy
    if isinstance(value, (*_SYMBOLIC, torch.Tensor)):
        return {e for e in _exprs(value, offsets=False) if isinstance(e, sympy.Symbol)}
    return set()


def _exprs(value, offsets: bool = True) -> Iterator:
    """The sympy expressions of the symbolic sizes, strides (and storage offsets) in `value`."""
    if isinstance(value, _SYMBOLIC):
        yield value.node.expr
    elif isinstance(value, torch.Tensor):
        parts = [value.shape]
        if value.layout == torch.strided:
            parts.append(value.stride())
            if offsets:
                parts.append((value.storage_offset(),))
        yield from (x.node.expr for part in parts for x in part if isinstance(x, torch.SymInt))
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _exprs(v, offsets)


def _introduced(node: fx.Node, exprs: list) -> set:
    """Unbacked symbols an op creates (a data-dependent size, `item()`): bound from this node on."""
    if (found := set(node.meta.get("unbacked_bindings") or ())) or node.op != "call_function":
        return found
    from torch.utils._sympy.symbol import SymT, symbol_is_type
    unbacked = (SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT)  # for graphs without `unbacked_bindings`
    return {s for expr in exprs for s in expr.free_symbols if symbol_is_type(s, unbacked)}


def _static(placeholders) -> bool:
    """Whether fake values' shape env never made a symbol (none unbound: a look-up, not a scan); False if unknown."""
    from torch._guards import detect_fake_mode
    try:
        mode = detect_fake_mode([node_value(p) for p in placeholders])
    except Exception:  # inputs of several fake modes: scan
        return False
    if mode is None:
        return False
    env = mode.shape_env
    return env is None or (isinstance(getattr(env, "var_to_range", None), dict) and not env.var_to_range)


def _op(node: fx.Node) -> str:
    target = node.target
    return str(target) if isinstance(target, (str, torch._ops.OpOverload)) else getattr(target, "__name__", str(target))


def _show(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}"
    return type(value).__name__ + (f" {value}" if isinstance(value, _SYMBOLIC) else "")
