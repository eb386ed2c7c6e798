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

Applied only where it can only win: half-precision q/k/v on the devices given (CUDA by default).
In fp32 no fused CUDA kernel takes grouped k/v (memory-efficient attention does not), and SDPA would
fall back to its math path, materializing the attention matrix. The compiler runs it on every
captured graph (`pipeline/compiler.py`); it is a pass too, so a trace shows it as a step.
"""
from __future__ import annotations

from typing import Optional, Sequence

import operator

import torch
import torch.fx as fx

from ir import Trace, node_value

from .base import TracePass

SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
HALF = (torch.bfloat16, torch.float16)
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


def grouped_kv_attention(devices: Sequence[str] = ("cuda",)) -> TracePass:
    """The pass (before autodiff). See the module docstring."""
    return TracePass(lambda trace: grouped_kv_attention_in(trace, devices), runs_on="before_autodiff",
                     name="grouped_kv_attention")


def grouped_kv_attention_in(trace: Trace, devices: Sequence[str] = ("cuda",)) -> Trace:
    """`trace` with every SDPA on k/v repeated per query head reading the grouped k/v instead;
    `trace` itself if there is none."""
    gm = trace.editable()
    rewritten = [node for node in gm.graph.nodes if _rewrite(node, devices)]
    if not rewritten:
        return trace
    for node in list(reversed(gm.graph.nodes)):  # the repeats nothing reads any more
        repeat = _repeat_of(node) if not node.users else None
        for step in repeat[2] if repeat else ():
            if step.users:
                break
            gm.graph.erase_node(step)
    gm.graph.lint()
    gm.recompile()
    return trace.derive(gm, by="grouped_kv_attention")


def _rewrite(node: fx.Node, devices) -> bool:
    if node.op != "call_function" or node.target not in SDPA or node.kwargs.get("enable_gqa"):
        return False
    args = {**dict(zip(SDPA_ARGS, node.args)), **node.kwargs}
    q, k, v = (args.get(name) for name in SDPA_ARGS[:3])
    rk, rv = _repeat_of(k), _repeat_of(v)
    if rk is None or rv is None or rk[1] != rv[1]:
        return False
    qv, kv, vv = (node_value(n) for n in (q, rk[0], rv[0]))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.dtype in HALF and t.device.type in devices
               for t in (qv, kv, vv)):
        return False
    if not _same((kv.shape[1] * rk[1], vv.shape[1]), (qv.shape[1], kv.shape[1])):
        return False
    args.update(key=rk[0], value=rv[0])
    positional = [args.pop(name) for name in SDPA_ARGS[:len(node.args)]]
    node.args, node.kwargs = tuple(positional), {**args, "enable_gqa": True}
    return True


def _repeat_of(node) -> Optional[tuple[fx.Node, int, list[fx.Node]]]:
    """(source, n, the nodes doing the repeat, last first) when `node` repeats each head of a 4-D
    [batch, heads, seq, head_dim] tensor n times consecutively (an int n): `source.repeat_interleave(n,
    dim=1)`, or `source[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)` (Hugging Face's
    `repeat_kv`); else None."""
    return _repeat_interleave(node) or _expand_reshape(node)


def _repeat_interleave(node):
    if not _is(node, "repeat_interleave", (torch.repeat_interleave, torch.Tensor.repeat_interleave)) \
            or len(node.args) < 2:
        return None
    source, repeats = node.args[0], node.args[1]
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
    value = node_value(source) if isinstance(source, fx.Node) else None
    if not (isinstance(repeats, int) and isinstance(value, torch.Tensor) and value.dim() == 4
            and dim in (1, -3) and "output_size" not in node.kwargs):
        return None
    return source, repeats, [node]


def _expand_reshape(node):
    if not _is(node, ("reshape", "view"), (torch.reshape, torch.Tensor.reshape, torch.Tensor.view)):
        return None
    expand = node.args[0]
    if not _is(expand, "expand", (torch.Tensor.expand,)):
        return None
    unsqueezed = expand.args[0]
    if not (_is(unsqueezed, "unsqueeze", (torch.unsqueeze, torch.Tensor.unsqueeze))
            or _is(unsqueezed, "__getitem__", (operator.getitem,)) and _only_new_axes(unsqueezed.args[1])):
        return None
    source = unsqueezed.args[0]
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
