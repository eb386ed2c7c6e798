"""`causal_attention()`: SDPA given an explicit causal mask runs with `is_causal=True` instead: a mask depending on no
input is computed at compile time and, if causal, dropped (why, which masks stay: docs/passes.md)."""

from typing import Optional

import torch
import torch.fx as fx

from ir import Trace, node_value
from ir.rewrite import Call, Match, derive_rewritten, rewrite
from ir.torch_ops import SDPA, SDPA_PARAMS, erase_unread, writes_into

from .base import TracePass, pass_factory

MASKED_ATTENTION = Call(  # SDPA given a mask node and no causal flag
    SDPA, SDPA_PARAMS, query="query", key="key", attn_mask="mask", is_causal=lambda causal: not causal)

# calls whose result can differ from call to call with no input changing: such a mask is no constant
_NOT_CONSTANT = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial", "poisson", "exponential",
                 "geometric", "cauchy", "empty")
# calls whose result may share memory with their input (a write into it would reach the mask)
_ALIASING = {"view", "view_as", "reshape", "expand", "expand_as", "transpose", "t", "permute", "unsqueeze",
             "squeeze", "flatten", "unflatten", "narrow", "select", "__getitem__", "getitem", "as_strided",
             "detach", "diagonal", "movedim", "swapaxes", "split", "chunk", "unbind", "unfold", "contiguous",
             "to", "type", "type_as", "float", "bool", "half", "bfloat16", "double", "int", "long"}
_LARGEST = 2 ** 30  # bytes per tensor a mask is computed with at compile time (a 32k x 32k bool mask)


@pass_factory
def causal_attention() -> TracePass:
    """The pass (before autodiff, before `grouped_kv_attention`). See the module docstring."""
    return TracePass(causal_attention_in, runs_on="before_autodiff", name="causal_attention")


def causal_attention_in(trace: Trace) -> Trace:
    """`trace` with every SDPA whose constant mask is the causal one made causal by flag; `trace` itself if none."""
    gm = trace.editable()
    decided: dict[tuple, bool] = {}  # one mask is often shared by every layer: computed once per shape

    def is_causal_mask(m: Match) -> bool:
        mask, query, key = m["mask"], m.value("query"), m.value("key")
        if not isinstance(mask, fx.Node) or not _fits(node_value(mask), query, key):
            return False
        if (seen := (mask, tuple(query.shape), key.shape[-2])) not in decided:
            decided[seen] = _equals_causal(_constant(gm, mask))
        return decided[seen]

    if not (done := rewrite(gm.graph, [(MASKED_ATTENTION, _causal_by_flag, is_causal_mask)])):
        return trace
    erase_unread([m["mask"] for m in done])
    return derive_rewritten(trace, gm, "causal_attention")


def _causal_by_flag(m: Match) -> None:
    args, kwargs = list(m.root.args), {k: v for k, v in m.root.kwargs.items() if k != "attn_mask"}
    if len(args) > 3:
        args[3] = None
    if len(args) > 5:
        args[5] = True
    else:
        kwargs["is_causal"] = True
    m.root.args, m.root.kwargs = tuple(args), kwargs


def _fits(mask, query, key) -> bool:
    """Whether a mask of this fake value could be SDPA's causal one for `query` and `key`: [.., L, S] of
    static sizes, bool or float, its leading dims 1 or the query's (not broadcasting the output)."""
    if not all(isinstance(t, torch.Tensor) and all(isinstance(d, int) for d in t.shape) for t in (mask, query, key)) \
            or query.dim() != 4 or key.dim() != 4 or not 2 <= mask.dim() <= 4 or mask.device.type == "meta":
        return False
    leading = zip(reversed(mask.shape[:-2]), reversed(query.shape[:-2]))
    return ((mask.dtype == torch.bool or mask.is_floating_point())
            and tuple(mask.shape[-2:]) == (query.shape[-2], key.shape[-2]) and all(d in (1, q) for d, q in leading))


def _equals_causal(mask: Optional[torch.Tensor]) -> bool:
    """Whether SDPA reads `mask` [.., L, S] as `ones(L, S).tril()` in every batch and head."""
    if mask is None:
        return False
    causal = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return torch.equal(mask, causal.expand_as(mask))
    kept, dropped = mask == 0, mask <= torch.finfo(mask.dtype).min
    return bool((kept | dropped).all()) and torch.equal(kept, causal.expand_as(kept))


def _constant(gm: fx.GraphModule, node: fx.Node) -> Optional[torch.Tensor]:
    """The value of `node` computed now, when it depends on constants only (else None)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    if (nodes := _ancestors(node)) is None:
        return None
    graph, env = fx.Graph(), {}
    for n in nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(env[node])
    with unset_fake_temporarily(), torch.no_grad():
        value = fx.GraphModule(gm, graph)()
    return value if isinstance(value, torch.Tensor) else None


def _ancestors(node: fx.Node) -> Optional[list[fx.Node]]:
    """The nodes `node` is computed from, in graph order; None unless each is a call without side
    effects, random draws or uninitialized memory, of at most `_LARGEST` bytes, never written into (nor a view)."""
    seen, work = {node}, [node]
    while work:
        n = work.pop()
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        value = node_value(n)
        size = _bytes(value) if isinstance(value, torch.Tensor) else 0  # symbolic: not a constant
        if (n.op not in ("call_function", "call_method", "get_attr") or n.is_impure() or writes_into(n)
                or any(r in name for r in _NOT_CONSTANT) or not isinstance(size, int) or size > _LARGEST):
            return None
        new = [i for i in n.all_input_nodes if i not in seen]
        seen.update(new)
        work += new
    return None if _written(seen) else [n for n in node.graph.nodes if n in seen]


def _bytes(value: torch.Tensor):  # the memory behind `value` (an expanded view's storage's bytes)
    try:
        return value.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return value.numel() * value.element_size()


def _written(nodes: set[fx.Node]) -> bool:
    """Whether a call may write into `nodes`' tensors or views: any in-place call reading one (whatever it writes)."""
    aliases, work = set(nodes), list(nodes)
    while work:
        for user in work.pop().users:
            if writes_into(user):
                return True
            name = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", "")
            if user not in aliases and name in _ALIASING:
                aliases.add(user)
                work.append(user)
    return False


