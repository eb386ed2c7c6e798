"""Helpers on region graphs and their ops that executors and the dispatcher share."""

import operator

import torch
import torch.fx as fx

from ir import node_value


def promised_strides(region: fx.GraphModule) -> list[tuple[int, tuple[int, ...]]]:
    """(output index, stride) of each output of `region` with a static promised layout: what other regions expect."""
    outs = region.graph.find_nodes(op="output")[0].args[0]
    values = [(i, node_value(n)) for i, n in enumerate(outs) if isinstance(n, fx.Node)]
    return [(i, tuple(v.stride())) for i, v in values
            if isinstance(v, torch.Tensor) and all(isinstance(s, int) for s in v.stride())]


def keep_promised_strides(outs: list, promised: list[tuple[int, tuple[int, ...]]]) -> list:
    """`outs` (in place) with each output laid out differently from its promise copied into it."""
    for i, stride in promised:
        if (t := outs[i]).stride() != stride and t.numel() > 1:  # one element: any stride is the same
            outs[i] = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)
    return outs


def is_symbolic_glue(target) -> bool:
    """Python-level arithmetic on sizes (operator.mul on SymInts, sym_size, ...)."""
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace == "aten" and target._opname.startswith("sym_")
    module = getattr(target, "__module__", "") or ""
    return module in ("_operator", "operator", "math") or getattr(target, "__name__", "").startswith("sym_")


_VIEW_LIKE = (torch.ops.aten.detach.default, torch.ops.aten._unsafe_view.default)


def computes_nothing(target) -> bool:
    """Views, tuple elements and shape arithmetic: ops that cost nothing wherever they run."""
    return target is operator.getitem or is_symbolic_glue(target) or (
        isinstance(target, torch._ops.OpOverload) and (target.is_view or target in _VIEW_LIKE))


def op_name(target) -> str:
    """An op's short name: `mul`, `pipeline_te.linear`, `getitem`."""
    if isinstance(target, torch._ops.OpOverload):
        ns = "" if target.namespace == "aten" else f"{target.namespace}."
        return f"{ns}{target._opname}"
    return getattr(target, "__name__", str(target))


_CPU_FFT = ("_fft_r2c", "_fft_c2c", "_fft_c2r")


def meta_strides_unreliable(node: fx.Node) -> bool:
    """Whether `node`'s fake (meta) output strides may differ from its real kernel's: the CPU FFT ops before torch 2.13
    (torch.compile fails on them too). They run on `torch`, whose region copies them into the promised layout."""
    if not (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target.namespace == "aten" and node.target._opname in _CPU_FFT):
        return False
    from torch.torch_version import TorchVersion
    if TorchVersion(torch.__version__) >= "2.13":
        return False
    x = node_value(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
    return isinstance(x, torch.Tensor) and x.device.type == "cpu"


def donated_inputs(gm: fx.GraphModule) -> list[int]:
    """Positions of a region's inputs nothing reads after it (marked in dispatch): executors may reuse their memory."""
    return [i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder") if n.meta.get("donated")]
