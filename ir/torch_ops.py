"""Facts about torch-level ops that passes and executors share (both import `ir`, not each other)."""
import operator

import torch
import torch.fx as fx

from .rewrite import Call

# The calls a captured `nn.Linear` / `F.linear` is in a torch-level trace, and the pattern of one.
LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)
LINEAR = Call(LINEARS, ("input", "weight", "bias"), input="x", weight="w", bias="b")

# The calls a captured `F.scaled_dot_product_attention` is, and its parameters in signature order.
SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def writes_into(node: fx.Node) -> bool:
    """Whether `node` may write into a tensor: an in-place method or function (`mul_`, `copy_`, `operator.iadd`; not
    `operator.and_`, though named with `_`), item assignment, `out=`/`inplace=True`, or an op with a mutable schema."""
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if node.op not in ("call_method", "call_function"):
        return False
    if getattr(target, "__module__", None) == "_operator":
        return target is operator.setitem or name in _OPERATOR_IN_PLACE
    schema = getattr(target, "_schema", None)
    return (name.endswith("_") and not name.endswith("__") or "out" in node.kwargs
            or node.kwargs.get("inplace") is True or schema is not None and schema.is_mutable)


# calls after which later calls run under another grad mode or autocast state (`with torch.no_grad()`, autocast)
MODE_CHANGES = frozenset({torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast,
                          torch._C._set_grad_enabled, torch.autograd.grad_mode._enter_inference_mode,
                          torch.autograd.grad_mode._exit_inference_mode})


def changes_between(nodes) -> bool:
    """Whether a call between the first and the last of `nodes` (one graph's) writes in place or changes grad mode or
    autocast: a rewrite joining or moving them would read the write, or run them all under one mode."""
    inside, node, last = set(nodes), min(nodes), max(nodes)  # nodes order as their graph does: walk the span only
    while (node := node.next) is not last:
        if node not in inside and (writes_into(node) or node.op == "call_function" and node.target in MODE_CHANGES):
            return True
    return False


def erase_unread(nodes) -> None:
    """Erases `nodes` nothing reads, then inputs so left unread; never graph inputs, impure or writing calls."""
    work = list(nodes)
    while work:
        n = work.pop()
        if n._erased or n.users or n.op == "placeholder" or n.is_impure() or writes_into(n):
            continue
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        work.extend(inputs)


_OPERATOR_IN_PLACE = {"iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior",
                      "ixor", "ilshift", "irshift"}
