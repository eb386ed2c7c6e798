"""`grouped_kv_attention()`: attention reads grouped keys/values (`enable_gqa=True`), not copies repeated to every query
head, where it can only win (`_can_win`: half precision on the given devices; why, what it gains: docs/passes.md)."""

from typing import Optional, Sequence

import operator

import torch

from ir import Trace, node_value
from ir.torch_ops import SDPA, SDPA_PARAMS, changes_between, erase_unread
from ir.rewrite import Call, Either, Match, derive_rewritten, rewrite

from .base import TracePass, pass_factory

HALF = (torch.bfloat16, torch.float16)


def _only_new_axes(index) -> bool:
    """An index that only inserts axes (None) and takes whole dims (`:` or `...`)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or i == slice(None) for i in items)


def _repeated(x: str) -> Either:
    """`x` with its heads repeated, binding `x` (the source) and `x_repeat` (the last call), and
    `x_n` (`x.repeat_interleave(n, dim=1)`) or `x_new_axis`, `x_expanded` (Hugging Face's `repeat_kv`:
    `x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)`); `_heads_repeated` checks shapes."""
    new_axis = (Call("unsqueeze", ("input", "dim"), x + "_new_axis", input=x)
                | Call(("__getitem__", operator.getitem), ("input", "index"), x + "_new_axis", input=x,
                       index=_only_new_axes))
    expanded = Call("expand", ("input", "*size"), x + "_expanded", input=new_axis)
    return (Call("repeat_interleave", ("input", "repeats", "dim"), x + "_repeat", input=x, repeats=x + "_n",
                 dim=lambda d: d in (1, -3))
            | Call(("reshape", "view"), ("input", "*shape"), x + "_repeat", input=expanded))


ATTENTION_ON_REPEATS = Call(  # SDPA on repeated k, v and no mask (no fused kernel takes grouped k/v and a mask)
    SDPA, SDPA_PARAMS, query="q", key=_repeated("k"), value=_repeated("v"), enable_gqa=lambda gqa: not gqa, attn_mask=lambda mask: mask is None)


@pass_factory
def grouped_kv_attention(devices: Sequence[str] = ("cuda",)) -> TracePass:
    return TracePass(lambda trace: grouped_kv_attention_in(trace, devices), runs_on="before_autodiff",
                     name="grouped_kv_attention")


def grouped_kv_attention_in(trace: Trace, devices: Sequence[str] = ("cuda",)) -> Trace:
    """`trace` with every SDPA on k/v repeated per query head reading grouped k/v instead; `trace` itself if none."""
    gm = trace.editable()
    done = rewrite(gm.graph, [(ATTENTION_ON_REPEATS, _read_grouped, lambda m: _can_win(m, devices))])
    if not done:
        return trace
    erase_unread(n for m in done for n in m.nodes[1:])
    return derive_rewritten(trace, gm, "grouped_kv_attention")


def _read_grouped(m: Match) -> None:
    for x in "kv":
        m.root.replace_input_with(m[x + "_repeat"], m[x])
    m.root.kwargs = {**m.root.kwargs, "enable_gqa": True}


def _can_win(m: Match, devices) -> bool:
    """Whether the attention `m` matched repeats k/v heads per group, in half precision (the inputs', or the output's
    under autocast: `mixed_precision` keeps q/k/v fp32) on `devices`, nothing written in place and no grad mode or
    autocast change from the first repeat on (`changes_between`)."""
    nk, nv = _heads_repeated(m, "k"), _heads_repeated(m, "v")
    out, qv, kv, vv = node_value(m.root), m.value("q"), m.value("k"), m.value("v")
    return (nk is not None and nk == nv and isinstance(out, torch.Tensor) and out.dtype in HALF
            and all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.device.type in devices for t in (qv, kv, vv))
            and _same((kv.shape[1] * nk, vv.shape[1]), (qv.shape[1], kv.shape[1]))
            and not changes_between(m.nodes))


def _heads_repeated(m: Match, x: str) -> Optional[int]:
    """The int n when the repeat under `x` repeats each head of 4-D `x` [b, h, s, d] n times in a row, else None."""
    src, u, e, r = (m.value(x + s) for s in ("", "_new_axis", "_expanded", "_repeat"))
    if not isinstance(src, torch.Tensor) or src.dim() != 4:
        return None
    if x + "_n" in m:  # repeat_interleave
        return m[x + "_n"] if isinstance(m[x + "_n"], int) else None
    (b, h, s, d), n = src.shape, e.shape[2] if isinstance(e, torch.Tensor) and e.dim() == 5 else None
    ok = (isinstance(n, int) and isinstance(u, torch.Tensor) and isinstance(r, torch.Tensor)
          and (tuple(u.shape), tuple(e.shape)) == ((b, h, 1, s, d), (b, h, n, s, d)) and _same(r.shape, (b, h * n, s, d)))
    return n if ok else None


def _same(a, b) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))
