"""`group_linears()`: linears reading one input (q/k/v, gate/up) become one linear on their stacked weights, its output
split along the last dim (when it pays: docs/passes.md). The stacked weights are tagged `recompute`: the backward
concatenates them again, no copy kept (0.9 GiB, 1B Llama, bf16). A piece `.view()`ed as no slice can be is copied."""

import contextlib
import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ir import Trace, fake_like, node_value
from ir.rewrite import Call, Match, add_call, derive_rewritten, find, match
from ir.torch_ops import LINEAR, LINEARS, changes_between
from ir.typecheck import refresh_values

from .base import TracePass, pass_factory

__all__ = ["group_linears", "group_linears_in", "LINEARS"]
VIEW = Call("view", ("input", "*shape"), shape="shape")


@pass_factory
def group_linears() -> TracePass:
    return TracePass(group_linears_in, runs_on="before_autodiff", name="group_linears")


def group_linears_in(trace: Trace) -> Trace:
    """`trace` with groups of 2+ linears on one input (one weight dtype, all or none biased) made one; else itself."""
    gm = trace.editable()
    if not (groups := _groups(gm.graph)):
        return trace
    # a group's arguments are read again when it is joined: an earlier group's outputs may feed it
    pieces = [piece for group in groups for piece in _join(gm.graph, [match(LINEAR, m.root) for m in group])]
    refresh_values(pieces)  # the linears' users now read slices of the stacked output
    return derive_rewritten(trace, gm, "group_linears")


def _stackable(m: Match) -> bool:
    """A linear on a tensor node whose weight is a 2-D tensor node of a static number of rows."""
    wv, xv = m.value("w"), m.value("x")
    return isinstance(wv, torch.Tensor) and isinstance(xv, torch.Tensor) and wv.dim() == 2 and isinstance(wv.shape[0], int)


def _groups(graph: fx.Graph) -> list[list[Match]]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_key: dict[tuple, list[Match]] = {}
    for m in find(graph, LINEAR, _stackable):
        wv = node_value(m["w"])
        by_key.setdefault((m["x"], wv.dtype, wv.device, m["b"] is None), []).append(m)
    groups = []
    for matches in by_key.values():
        first = min(order[m.root] for m in matches)
        # the stacked weight is built before the group's first linear: its weights must exist there
        ready = [m for m in matches if all(not isinstance(a, fx.Node) or order[a] < first for a in (m["w"], m["b"]))]
        if len(ready) >= 2 and not changes_between([m.root for m in ready]):  # a write or a no_grad between: apart
            groups.append(ready)
    return groups


def _join(graph: fx.Graph, group: list[Match]) -> list[fx.Node]:
    x, bias, weights, nodes = group[0]["x"], group[0]["b"], [m["w"] for m in group], [m.root for m in group]
    widths = [node_value(w).shape[0] for w in weights]
    y0, w0 = node_value(nodes[0]), node_value(weights[0])
    with graph.inserting_before(nodes[0]):
        stacked = add_call(graph, torch.cat, (weights, 0), fake_like(w0, (sum(widths), w0.shape[1])))
        b = None if bias is None else add_call(graph, torch.cat, ([m["b"] for m in group], 0),
                                               fake_like(node_value(bias), (sum(widths),)))
        for stack in (stacked,) if b is None else (stacked, b):
            stack.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        y = add_call(graph, torch._C._nn.linear, (x, stacked, b), fake_like(y0, (*y0.shape[:-1], sum(widths))))
        stride = node_value(y).stride()
        pieces = [fake_like(y0, (*y0.shape[:-1], n), stride=stride) for n in widths]
        split = add_call(graph, torch.split, (y, widths, -1), tuple(pieces))
        made = []
        for i, node in enumerate(nodes):
            piece = add_call(graph, operator.getitem, (split, i), pieces[i])
            if not _views_allowed(node, pieces[i]):  # a user views it in a way a slice cannot be
                piece = add_call(graph, "contiguous", (piece,), fake_like(y0, pieces[i].shape))
            node.replace_all_uses_with(piece)
            made.append(piece)
    for node in nodes:
        graph.erase_node(node)
    return made


def _views_allowed(node: fx.Node, piece) -> bool:
    """Whether each `.view(...)` of the linear's output works on `piece`, a slice of the stacked output (not all do),
    and none is `as_strided` (whose strides would land in the stacked output)."""
    if any(user.target in ("as_strided", torch.as_strided) for user in node.users):
        return False
    for view in (m for user in node.users if (m := match(VIEW, user))):
        args = [node_value(a) if isinstance(a, fx.Node) else a for a in view["shape"] or ()]
        try:
            with piece.fake_mode if hasattr(piece, "fake_mode") else contextlib.nullcontext():
                piece.view(*args)
        except Exception:
            return False
    return True
