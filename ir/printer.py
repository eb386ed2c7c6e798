"""Prints a `Trace` as readable, runnable Python, Thunder style: one op per line, its value's shape and dtype as a
comment, inputs and outputs in the header. `python_callable(trace)` executes that text: what is printed is what runs."""

import builtins
import math
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from .trace import Trace, describe_value, node_value

_HEADER = "\n".join(["import operator", "import torch", "from torch import device, inf, nan",
                     "aten = torch.ops.aten", "prims = torch.ops.prims", ""])


def python_source(trace: Trace) -> str:
    """The trace as a Python module defining `def <name>(...)`."""
    names = _Names()
    lines = [f"# Trace {trace.name!r} · level {trace.level} · made by: "
             + (" → ".join(s.name for s in trace.provenance) or "-")]
    params = []
    for node, spec in zip(trace.placeholders(), [*trace.inputs, *[None] * len(trace.placeholders())]):
        params.append(name := names.bind(node, _readable_name(spec)))
        what = "(no input spec)" if spec is None else spec.kind + (f" {spec.qualname!r}" if spec.qualname else "")
        lines.append(f"#   {name}: {describe_value(node_value(node))}  {what}{_tags(node)}".rstrip())
    lines.insert(1, "# inputs:")
    if len(trace.inputs) != len(params):  # a malformed trace prints, and says so
        lines.insert(2, f"#   MALFORMED: {len(trace.inputs)} input specs for {len(params)} placeholders")
    lines += [_HEADER, f"def {_identifier(trace.name)}({', '.join(params)}):"]
    for node in trace.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            kinds = ", ".join(s.kind + (f"→{s.target}" if s.target else "") for s in trace.outputs)
            lines.append(f"    return {_format(node.args[0], names)}" + (f"  # {kinds}" if trace.outputs else ""))
            continue
        name, expr = names.bind(node), _expression(node, names)
        lines.append(f"    {name} = {expr}  # {describe_value(node_value(node))}{_tags(node)}")
    return "\n".join(lines) + "\n"


def python_globals(trace: Trace) -> dict[str, Any]:
    """The values a printed trace refers to that are not in its text: constants and submodules."""
    return {_identifier(node.target): operator.attrgetter(node.target)(trace.module)
            for node in trace.graph.nodes if node.op in ("get_attr", "call_module")}


def python_callable(trace: Trace) -> Callable:
    namespace = python_globals(trace)
    exec(compile(python_source(trace), f"<trace {trace.name}>", "exec"), namespace)
    return namespace[_identifier(trace.name)]


class _Names:
    """Maps nodes to the Python identifiers they get in the printed text."""

    def __init__(self):
        self.of: dict[fx.Node, str] = {}
        self.taken: set[str] = set()

    def bind(self, node: fx.Node, preferred: str | None = None) -> str:
        if (name := _identifier(preferred or node.name)) in self.taken or name in _RESERVED:
            name = f"{name}_{len(self.taken)}"
        self.taken.add(name)
        self.of[node] = name
        return name


_RESERVED = {"operator", "torch", "device", "inf", "nan", "aten", "prims"} | set(dir(builtins))


def _readable_name(spec) -> str | None:
    """`layers_0_attn_wq_weight` for a parameter, `tokens` for the user input L['tokens']."""
    if spec is None or not spec.qualname:
        return None
    if spec.kind in ("parameter", "buffer"):
        return spec.qualname.replace(".", "_")
    inner = spec.qualname.removeprefix("L['").split("'", 1)[0]
    return inner if inner.isidentifier() else None


def _tags(node: fx.Node) -> str:
    """The tags passes communicate through (executor, recompute, donated), as the node's comment shows them."""
    policy = node.meta.get("recompute")
    tags = [f"executor={node.meta['executor']}" if node.meta.get("executor") else "",
            "" if policy is None else f"recompute={getattr(policy, 'name', policy)}",
            "donated" if node.meta.get("donated") else ""]
    return f"  [{', '.join(t for t in tags if t)}]" if any(tags) else ""


def _identifier(name: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in str(name))
    return out if out and not out[0].isdigit() else "_" + out


def _expression(node: fx.Node, names: _Names) -> str:
    args = [_format(a, names) for a in node.args]
    args += [f"{k}={_format(v, names)}" for k, v in node.kwargs.items()]
    if node.op == "get_attr":
        return _identifier(node.target)
    if node.op == "call_module":
        return f"{_identifier(node.target)}({', '.join(args)})"
    if node.op == "call_method":
        return f"{args[0]}.{node.target}({', '.join(args[1:])})"
    if node.target is operator.getitem:
        return f"{args[0]}[{args[1]}]"
    return f"{_callable_name(node.target)}({', '.join(args)})"


def _callable_name(fn) -> str:
    if isinstance(fn, torch._ops.OpOverload):
        prefix = "" if fn.namespace in ("aten", "prims") else "torch.ops."
        return f"{prefix}{fn.namespace}.{fn._opname}.{fn._overloadname}"
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return f"torch.ops.{fn._qualified_op_name.replace('::', '.')}"
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
    if module in ("_operator", "operator"):
        return f"operator.{fn.__name__}"
    if module == "builtins" or getattr(builtins, qualname, None) is fn:
        return qualname
    if module and module.startswith("torch"):  # often defined in a private module, public elsewhere (torch._C._nn.gelu)
        for public in ("torch", "torch.nn.functional", "torch.Tensor"):
            if getattr(eval(public, {"torch": torch}), getattr(fn, "__name__", ""), None) is fn:
                return f"{public}.{fn.__name__}"
    return f"{module}.{qualname}"


def _format(a: Any, names: _Names) -> str:
    if isinstance(a, fx.Node):
        return names.of[a]
    if isinstance(a, tuple):
        inner = ", ".join(_format(x, names) for x in a)
        return f"({inner},)" if len(a) == 1 else f"({inner})"
    if isinstance(a, list):
        return "[" + ", ".join(_format(x, names) for x in a) + "]"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_format(v, names)}" for k, v in a.items()) + "}"
    if isinstance(a, float) and not math.isfinite(a):
        return "nan" if math.isnan(a) else ("inf" if a > 0 else "-inf")
    if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
        return str(a)
    if isinstance(a, torch.device):
        return f"device({str(a)!r})"
    if isinstance(a, slice):
        return f"slice({_format(a.start, names)}, {_format(a.stop, names)}, {_format(a.step, names)})"
    return "..." if a is Ellipsis else repr(a)
