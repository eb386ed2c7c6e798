"""`grouped_kv_attention()`: attention reads grouped keys/values directly instead of copies repeated
to every query head.

Grouped-query attention models (Llama's 8 k/v heads for 32 query heads) often repeat k and v to
every head before SDPA: `sdpa(q, k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1))`, or
with Hugging Face's `repeat_kv` (`k[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)`).
That writes n copies of k and v in the forward and sums the n copies' gradients in the backward;
SDPA's `enable_gqa=True` gives each query head its group's k/v inside the kernel (the same
`repeat_interleave` grouping, so results match). H200, bf16, batch 4 x 32 heads x seq 2048 x 64,
causal, forward + backward with the repeat: cuDNN 0.861 -> 0.764 ms per layer, flash 1.305 ->
1.232 ms (`benchmarks/sdpa_gpu.py`).

Applied only where it can only win: attention in half precision (bf16/fp16 q/k/v, or under autocast,
as `mixed_precision` sets) on the devices given (CUDA by default). In fp32 no fused CUDA kernel of
torch 2.11 takes grouped k/v (memory-efficient attention declined them on the H200), and SDPA would
fall back to its math path, materializing the attention matrix. Not where the repeated copies or k/v
are written in place before the attention reads them. The compiler runs it on every
captured graph after the before-autodiff passes (`pipeline/compiler.py`); it is a pass too, and the
traces show it as a step.
"""
from __future__ import annotations

from typing import Optional, Sequence

import operator

import torch
import torch.fx as fx

from ir import Trace, node_value

from .base import TracePass, pass_factory

SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
HALF = (torch.bfloat16, torch.float16)
SIZE_MATH = (operator.mul, operator.floordiv, operator.add, operator.sub)
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


@pass_factory
def grouped_kv_attention(devices: Sequence[str] = ("cuda",)) -> TracePass:
    """The pass (before autodiff). See the module docstring."""
    return TracePass(lambda trace: grouped_kv_attention_in(trace, devices), runs_on="before_autodiff",
                     name="grouped_kv_attention")


def grouped_kv_attention_in(trace: Trace, devices: Sequence[str] = ("cuda",)) -> Trace:
    """`trace` with every SDPA on k/v repeated per query head reading the grouped k/v instead;
    `trace` itself if there is none."""
    gm = trace.editable()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    writes = [order[n] for n in gm.graph.nodes if _writes(n)]
    bypassed = [chain for node in list(gm.graph.nodes) for chain in _rewrite(node, devices, order, writes)]
    if not bypassed:
        return trace
    _erase_unused([n for chain in bypassed for n in chain])
    gm.graph.lint()
    gm.recompile()
    return trace.derive(gm, by="grouped_kv_attention")


def _rewrite(node: fx.Node, devices, order, writes) -> list[list[fx.Node]]:
    """Points the SDPA `node` at the grouped k/v if it reads repeated ones and can only win; returns
    the repeat chains it no longer reads (none: left alone)."""
    if node.op != "call_function" or node.target not in SDPA or node.kwargs.get("enable_gqa"):
        return []
    args = {**dict(zip(SDPA_ARGS, node.args)), **node.kwargs}
    q, k, v = (args.get(name) for name in SDPA_ARGS[:3])
    rk, rv = _repeat_of(k), _repeat_of(v)
    if rk is None or rv is None or rk[1] != rv[1]:
        return []
    # half precision where the attention runs: its inputs' dtype, or its output's under autocast
    # (`mixed_precision`: q/k/v may still be fp32 there, autocast casts them for SDPA)
    out, qv, kv, vv = (node_value(n) for n in (node, q, rk[0], rv[0]))
    if not (isinstance(out, torch.Tensor) and out.dtype in HALF and all(
            isinstance(t, torch.Tensor) and t.dim() == 4 and t.device.type in devices for t in (qv, kv, vv))):
        return []
    if not _same((kv.shape[1] * rk[1], vv.shape[1]), (qv.shape[1], kv.shape[1])):
        return []
    # the repeats are copies: a write into them, or into k/v, before the attention reads them would
    # make the grouped k/v differ from what the attention read
    first = min(order[n] for n in rk[2] + rv[2])
    if any(first <= w < order[node] for w in writes):
        return []
    args.update(key=rk[0], value=rv[0])
    positional = [args.pop(name) for name in SDPA_ARGS[:len(node.args)]]
    node.args, node.kwargs = tuple(positional), {**args, "enable_gqa": True}
    return [rk[2], rv[2]]


def _erase_unused(nodes: list[fx.Node]) -> None:
    """Erases the given nodes nothing reads any more, and then the size arithmetic (`h * n` under
    dynamic shapes) only they read."""
    chains, work = set(nodes), list(nodes)
    while work:
        node = work.pop(0)
        if node._erased or node.users:  # a chain shared by two attentions is listed twice
            continue
        if node in chains or node.op == "call_function" and node.target in SIZE_MATH:
            inputs = node.all_input_nodes
            node.graph.erase_node(node)
            work.extend(inputs)


def _repeat_of(node) -> Optional[tuple[fx.Node, int, list[fx.Node]]]:
    """(source, n, the nodes doing the repeat, last first) when `node` repeats each head of a 4-D
    [batch, heads, seq, head_dim] tensor n times consecutively (an int n): `source.repeat_interleave(n,
    dim=1)`, or `source[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)` (Hugging Face's
    `repeat_kv`); else None."""
    return _repeat_interleave(node) or _expand_reshape(node)


def _repeat_interleave(node):
    if not _is(node, "repeat_interleave", (torch.repeat_interleave, torch.Tensor.repeat_interleave)):
        return None
    source, repeats, dim = (_arg(node, i, name) for i, name in enumerate(("input", "repeats", "dim")))
    value = node_value(source) if isinstance(source, fx.Node) else None
    if not (isinstance(repeats, int) and isinstance(value, torch.Tensor) and value.dim() == 4
            and dim in (1, -3) and "output_size" not in node.kwargs):
        return None
    return source, repeats, [node]


def _expand_reshape(node):
    if not _is(node, ("reshape", "view"), (torch.reshape, torch.Tensor.reshape, torch.Tensor.view)):
        return None
    expand = _arg(node, 0, "input")
    if not _is(expand, "expand", (torch.Tensor.expand,)):
        return None
    unsqueezed = _arg(expand, 0, "input")
    if not (_is(unsqueezed, "unsqueeze", (torch.unsqueeze, torch.Tensor.unsqueeze))
            or _is(unsqueezed, "__getitem__", (operator.getitem,)) and _only_new_axes(_arg(unsqueezed, 1, "index"))):
        return None
    source = _arg(unsqueezed, 0, "input")
    values = [node_value(n) if isinstance(n, fx.Node) else None for n in (source, unsqueezed, expand, node)]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return None
    src, u, e, r = (tuple(v.shape) for v in values)
    if len(src) != 4 or len(e) != 5 or not isinstance(e[2], int):
        return None
    b, h, s, d = src
    n = e[2]
    if u != (b, h, 1, s, d) or e != (b, h, n, s, d) or not _same(r, (b, h * n, s, d)):
        return None
    return source, n, [node, expand, unsqueezed]


def _arg(node: fx.Node, i: int, name: str):
    """Argument `i` of a call, given by position or by name (`self` for a tensor method's first)."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, node.kwargs.get("self") if i == 0 else None)


def _writes(node: fx.Node) -> bool:
    """Whether `node` may write into a tensor: an in-place method or function (`mul_`, `copy_`),
    item assignment, `out=`/`inplace=True`, or an op whose schema mutates an argument."""
    if node.op not in ("call_method", "call_function"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    schema = getattr(node.target, "_schema", None)
    return (name.endswith("_") and not name.endswith("__") or node.target is operator.setitem
            or "out" in node.kwargs or node.kwargs.get("inplace") is True
            or schema is not None and schema.is_mutable)


def _is(node, methods, functions) -> bool:
    if not isinstance(node, fx.Node):
        return False
    methods = (methods,) if isinstance(methods, str) else methods
    return (node.op == "call_method" and node.target in methods
            or node.op == "call_function" and node.target in functions)


def _only_new_axes(index) -> bool:
    """An index that only inserts axes (None) and takes whole dims (`:` or `...`)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or i == slice(None) for i in items)


def _same(a, b) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))
