"""`group_linears()`: linears that read the same input become one linear on their stacked weights.

The q/k/v projections of attention and SwiGLU's gate/up projections read the same normalized
activations. One GEMM with the weights stacked along N replaces each group: fewer and larger GEMMs
(the narrow k/v projections are the least efficient ones), fewer kernel launches, and, with fp8
(the `te` executor), one cast of the shared input instead of one per linear. The weights are
concatenated in the trace on every call (a copy of the group's weights; autodiff splits the gradient
back), and again in the backward where its GEMM needs them: the partitioner would otherwise keep the
copy alive from forward to backward, a second copy of every grouped weight (0.9 GiB on the 1B Llama
in bf16; `recompute` tag, as activation checkpointing sets). The output is split along its last
dim, so results equal the separate linears up to GEMM rounding. A piece is a strided slice; where the model `.view()`s it in a way a slice cannot be
viewed (merging its last dim), that piece is copied contiguous first. Runs before autodiff, on the torch-level trace; with `te` listed, ask TE for it instead
(`te.options(group_linears=True)`), since TE swaps the linears before the passes run: TE then names
this pass in `passes_before_prepare()` and the pipeline runs it just before TE's `prepare`.
"""
from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ir import Trace, fake_like, node_value
from ir.torch_ops import LINEARS
from ir.typecheck import refresh_values

from .base import TracePass, pass_factory

__all__ = ["group_linears", "group_linears_in", "LINEARS"]


@pass_factory
def group_linears() -> TracePass:
    """The pass (before autodiff). See the module docstring."""
    return TracePass(group_linears_in, runs_on="before_autodiff", name="group_linears")


def group_linears_in(trace: Trace) -> Trace:
    """`trace` with every group of 2+ linears on the same input (same weight dtype, all with or all
    without bias) computed as one linear; `trace` itself if there is none."""
    gm = trace.editable()
    groups = _groups(gm.graph)
    if not groups:
        return trace
    pieces = [piece for group in groups for piece in _join(gm.graph, group)]
    refresh_values(pieces)  # the linears' users now read slices of the stacked output
    gm.graph.lint()
    gm.recompile()
    return trace.derive(gm, by="group_linears")


def _parts(node: fx.Node):
    """(x, weight, bias) of a linear node."""
    args = list(node.args) + [None] * (3 - len(node.args))
    return args[0], args[1], node.kwargs.get("bias", args[2])


def _groups(graph: fx.Graph) -> list[list[fx.Node]]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_key: dict[tuple, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in LINEARS:
            continue
        x, w, b = _parts(node)
        wv, xv = node_value(w), node_value(x)
        if not (isinstance(x, fx.Node) and isinstance(w, fx.Node) and isinstance(wv, torch.Tensor)
                and isinstance(xv, torch.Tensor) and wv.dim() == 2 and isinstance(wv.shape[0], int)):
            continue
        by_key.setdefault((x, wv.dtype, wv.device, b is None), []).append(node)
    groups = []
    for nodes in by_key.values():
        first = min(order[n] for n in nodes)
        # the stacked weight is built before the group's first linear: its weights must exist there
        ready = [n for n in nodes if all(not isinstance(a, fx.Node) or order[a] < first for a in _parts(n)[1:])]
        if len(ready) >= 2:
            groups.append(ready)
    return groups


def _join(graph: fx.Graph, group: list[fx.Node]) -> list[fx.Node]:
    x, _, bias = _parts(group[0])
    weights = [_parts(n)[1] for n in group]
    widths = [node_value(w).shape[0] for w in weights]
    y0, w0 = node_value(group[0]), node_value(weights[0])
    with graph.inserting_before(group[0]):
        stacked = _call(graph, torch.cat, (weights, 0), fake_like(w0, (sum(widths), w0.shape[1])))
        stacked.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        b = None
        if bias is not None:
            b0 = node_value(bias)
            b = _call(graph, torch.cat, ([_parts(n)[2] for n in group], 0), fake_like(b0, (sum(widths),)))
            b.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        y = _call(graph, torch._C._nn.linear, (x, stacked, b), fake_like(y0, (*y0.shape[:-1], sum(widths))))
        yv = node_value(y)
        pieces = [fake_like(y0, (*y0.shape[:-1], n), stride=yv.stride()) for n in widths]
        split = _call(graph, torch.split, (y, widths, -1), tuple(pieces))
        made = []
        for i, node in enumerate(group):
            piece = _call(graph, operator.getitem, (split, i), pieces[i])
            if not _views_allowed(node, pieces[i]):  # a user views it in a way a slice cannot be
                piece = _method(graph, "contiguous", (piece,), fake_like(y0, pieces[i].shape))
            node.replace_all_uses_with(piece)
            made.append(piece)
    for node in group:
        graph.erase_node(node)
    return made


def _views_allowed(node: fx.Node, piece) -> bool:
    """Whether every `.view(...)` of the linear's output is also possible on `piece`, a slice of the
    stacked output (merging its last dim with another, say, is not)."""
    for user in node.users:
        if not (user.op == "call_method" and user.target == "view"
                or user.op == "call_function" and user.target is torch.Tensor.view):
            continue
        args = [node_value(a) if isinstance(a, fx.Node) else a for a in user.args[1:]]
        try:
            with piece.fake_mode if hasattr(piece, "fake_mode") else contextlib.nullcontext():
                piece.view(*args)
        except Exception:
            return False
    return True


def _method(graph: fx.Graph, name, args, value) -> fx.Node:
    node = graph.call_method(name, args)
    node.meta["val"] = node.meta["example_value"] = value
    return node


def _call(graph: fx.Graph, target, args, value) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = node.meta["example_value"] = value
    return node
