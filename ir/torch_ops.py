"""Facts about torch-level ops that passes and executors share (both import `ir`, not each other)."""
import operator

import torch
import torch.fx as fx

from .rewrite import Call

# The calls a captured `nn.Linear` / `F.linear` is in a torch-level trace, and the pattern of one.
LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)
LINEAR = Call(LINEARS, ("input", "weight", "bias"), input="x", weight="w", bias="b")


def writes_into(node: fx.Node) -> bool:
    """Whether `node` may write into a tensor: an in-place method or function (`mul_`, `copy_`,
    `x += y` as `operator.iadd`), item assignment, `out=`/`inplace=True`, or an op whose schema
    mutates an argument. (`operator.and_` and its kind are not in place, though named with `_`.)"""
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if node.op not in ("call_method", "call_function"):
        return False
    if getattr(target, "__module__", None) == "_operator":
        return target is operator.setitem or name in _OPERATOR_IN_PLACE
    schema = getattr(target, "_schema", None)
    return (name.endswith("_") and not name.endswith("__") or "out" in node.kwargs
            or node.kwargs.get("inplace") is True or schema is not None and schema.is_mutable)


_OPERATOR_IN_PLACE = {"iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior",
                      "ixor", "ilshift", "irshift"}
