"""`causal_attention()`: attention handed an explicit causal mask runs with `is_causal=True` instead.

Hugging Face's models build their causal mask as a tensor whenever they are traced (transformers
5.17's `sdpa_mask` cannot tell, under Dynamo, that no token is padded) and pass it to SDPA as
`attn_mask`, with `is_causal=False` and k/v repeated to every query head (`repeat_kv`: SDPA's grouped
k/v take no mask). An explicit mask keeps SDPA off its flash and cuDNN kernels, which apply causality
by skipping the blocks above the diagonal instead of reading a mask: compiled HF models then lose to
the same model run eagerly, where HF leaves the mask out. This pass finds each such mask, computes it
once at compile time (it depends on no input of the graph), and where it is exactly SDPA's causal mask
(`ones(L, S).tril()`, as booleans, or as 0 / -inf or the dtype's lowest value added to the scores) for
every batch and head, drops it and sets `is_causal=True`; `grouped_kv_attention` then removes the
repeats. Masks read from an input (a padding mask the caller passes) are left as they are.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from ir import Trace, node_value
from ir.rewrite import Call, Match, rewrite

from .base import TracePass, pass_factory

# SDPA given a mask node and no causal flag
MASKED_ATTENTION = Call(
    (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention),
    ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"),
    query="query", key="key", attn_mask="mask", is_causal=lambda causal: not causal)

# ops whose result changes from call to call with no input changing: such a mask is not a constant
# masks are computed at compile time up to this size (a 32k x 32k causal mask); larger ones are left
_LARGEST = 2 ** 30
_RANDOM = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial", "poisson", "exponential",
           "geometric", "cauchy")


@pass_factory
def causal_attention() -> TracePass:
    """The pass (before autodiff, before `grouped_kv_attention`). See the module docstring."""
    return TracePass(causal_attention_in, runs_on="before_autodiff", name="causal_attention")


def causal_attention_in(trace: Trace) -> Trace:
    """`trace` with every SDPA whose mask is the causal one computed from constants made causal by
    flag; `trace` itself if there is none."""
    gm = trace.editable()
    masks: dict[fx.Node, bool] = {}  # one mask is often shared by every layer: computed once

    def is_causal_mask(m: Match) -> bool:
        mask = m["mask"]
        if not isinstance(mask, fx.Node):
            return False
        if mask not in masks:
            masks[mask] = _equals_causal(_constant(gm, mask), m.value("query"), m.value("key"))
        return masks[mask]

    done = rewrite(gm.graph, [(MASKED_ATTENTION, _causal_by_flag, is_causal_mask)])
    if not done:
        return trace
    _erase_unused(list(masks))
    gm.graph.lint()
    gm.recompile()
    return trace.derive(gm, by="causal_attention")


def _causal_by_flag(m: Match) -> None:
    args, kwargs = list(m.root.args), {k: v for k, v in m.root.kwargs.items() if k != "attn_mask"}
    if len(args) > 3:
        args[3] = None
    if len(args) > 5:
        args[5] = True
    else:
        kwargs["is_causal"] = True
    m.root.args, m.root.kwargs = tuple(args), kwargs


def _ancestors(node: fx.Node) -> Optional[list[fx.Node]]:
    """The nodes `node` is computed from, in graph order, if none is a graph input, a call with side
    effects or a random draw, and none makes a tensor larger than `_LARGEST` elements; else None."""
    seen, work = {node}, [node]
    while work:
        n = work.pop()
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        value = node_value(n)
        size = value.numel() if isinstance(value, torch.Tensor) else 0  # symbolic: not a constant
        if (n.op not in ("call_function", "call_method", "get_attr") or n.is_impure()
                or any(r in name for r in _RANDOM) or not isinstance(size, int) or size > _LARGEST):
            return None
        for i in n.all_input_nodes:
            if i not in seen:
                seen.add(i)
                work.append(i)
    return [n for n in node.graph.nodes if n in seen]


def _constant(gm: fx.GraphModule, node: fx.Node) -> Optional[torch.Tensor]:
    """The value of `node` computed now, when it depends on constants only (else None)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    nodes = _ancestors(node)
    if nodes is None:
        return None
    graph, env = fx.Graph(), {}
    for n in nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(env[node])
    with unset_fake_temporarily(), torch.no_grad():
        value = fx.GraphModule(gm, graph)()
    return value if isinstance(value, torch.Tensor) else None


def _equals_causal(mask: Optional[torch.Tensor], query, key) -> bool:
    """Whether SDPA reads `mask` (broadcast to [batch, heads, L, S]) as `ones(L, S).tril()`."""
    if mask is None or mask.device.type == "meta" or not all(
            isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key)):
        return False
    size = (query.shape[-2], key.shape[-2])
    if not all(isinstance(s, int) for s in size) or mask.dim() < 2 or tuple(mask.shape[-2:]) != size:
        return False
    causal = torch.ones(size, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return torch.equal(mask, causal.expand_as(mask))
    if not mask.is_floating_point():
        return False
    kept, dropped = mask == 0, mask <= torch.finfo(mask.dtype).min
    return bool((kept | dropped).all()) and torch.equal(kept, causal.expand_as(kept))


def _erase_unused(nodes: list[fx.Node]) -> None:
    """Erases the masks no attention reads any more and what only they were computed from."""
    work = list(nodes)
    while work:
        n = work.pop()
        if n._erased or n.users or n.is_impure() or n.op == "placeholder":
            continue
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        work.extend(inputs)
