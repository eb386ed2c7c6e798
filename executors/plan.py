"""Dispatch: turns an ATen trace into an execution trace whose ops are compiled regions.

`dispatch(trace, executors)` assigns ops (lazy decomposition included), partitions them into
regions, compiles each region with its executor — falling back to the next listed executor that
claims the whole region, then to `torch`, when compilation fails — and returns an `Execution`: the
execution trace (one `call_module` per region, printable and runnable) plus a `Region` per region.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
import time
from typing import Callable, Sequence

import torch
import torch.fx as fx

from ir import Region, Trace, describe_value, node_value

from .base import Executor
from .dispatch import Assignment, assign
from .partition import partition
from .torch_executor import torch_executor


class CompiledRegion(torch.nn.Module):
    """One region as it runs: the executor's compiled callable, named for the region.

    While `CompiledRegion.profiling` is set (by `pipeline.profile`), each call is a named range
    (`region3:inductor`) in the profiler's timeline and chrome trace."""

    profiling = False

    def __init__(self, fn: Callable, region: Region, source: fx.GraphModule):
        super().__init__()
        self.fn = fn
        self.region = region
        self.source = source  # the region's ATen graph, for inspection
        self.label = f"region{region.id}:{region.executor}"

    def forward(self, *args):
        if CompiledRegion.profiling:
            with torch.profiler.record_function(self.label):
                return self.fn(*args)
        return self.fn(*args)

    def extra_repr(self) -> str:
        return f"{self.region.executor}, {self.region.op_count} ops"


@dataclasses.dataclass
class Execution:
    trace: Trace
    regions: list[Region]
    assignment: Assignment


def dispatch(trace: Trace, executors: Sequence[Executor], *, stage: str, graph_id: str = "",
             fallback: Executor = torch_executor, first_region_id: int = 0) -> Execution:
    """Assigns, partitions and compiles `trace`; see the module docstring."""
    start = time.perf_counter()
    gm = trace.editable()
    assignment = assign(gm, executors, fallback)
    order = list(executors) + ([fallback] if all(e.name != fallback.name for e in executors) else [])
    named = partition(gm, order)
    by_name = {e.name: e for e in order}
    regions = []
    for k, (sub_name, ex_name) in enumerate(named):
        source = gm.get_submodule(sub_name)
        region = _describe(source, first_region_id + k, stage, ex_name, graph_id)
        fn = _compile_with_fallback(source, region, by_name[ex_name], order, fallback)
        gm.add_submodule(sub_name, CompiledRegion(fn, region, source))
        regions.append(region)
    _set_region_values(gm)
    gm.recompile()
    out = trace.derive(gm, by="dispatch", seconds=time.perf_counter() - start, name=trace.name)
    return Execution(out, regions, assignment)


def _compile_with_fallback(source, region, first: Executor, order, fallback) -> Callable:
    example_inputs = [node_value(n) for n in source.graph.nodes if n.op == "placeholder"]
    candidates = [first] + [e for e in order[order.index(first) + 1:]
                            if e is not first and _claims_all(e, source)]
    if all(c.name != fallback.name for c in candidates):
        candidates.append(fallback)
    reasons = []
    for ex in candidates:
        start = time.perf_counter()
        try:
            fn = _compile_isolated(ex, source, example_inputs)
        except Exception as e:  # a region an executor cannot compile runs on the next one
            reasons.append(f"{ex.name} failed to compile: {type(e).__name__}: {str(e).strip()[:300]}")
            continue
        region.compile_seconds = time.perf_counter() - start
        region.executor = ex.name
        region.fallback_reason = "; ".join(reasons) or None
        return fn
    raise RuntimeError(f"region {region.id}: no executor could compile it: {'; '.join(reasons)}")


def _compile_isolated(ex: Executor, source: fx.GraphModule, example_inputs):
    """Compiles under a fresh tracing context, so an executor's compile cannot disturb the
    AOTAutograd compilation this region is part of."""
    from torch._guards import TracingContext, detect_fake_mode, tracing
    fake_mode = detect_fake_mode(example_inputs)
    with tracing(TracingContext(fake_mode)) if fake_mode is not None else contextlib.nullcontext():
        return ex.compile_region(source, example_inputs)


def _claims_all(ex: Executor, gm: fx.GraphModule) -> bool:
    return all(ex.claims(n) for n in gm.graph.nodes
               if n.op == "call_function" and n.target is not operator.getitem)


def _describe(source: fx.GraphModule, rid: int, stage: str, ex_name: str, graph_id: str) -> Region:
    nodes = list(source.graph.nodes)
    ops = [_short(n.target) for n in nodes if n.op == "call_function" and n.target is not operator.getitem]
    ins = [describe_value(node_value(n)) for n in nodes if n.op == "placeholder"]
    out_node = nodes[-1]
    outs = [describe_value(node_value(a)) if isinstance(a, fx.Node) else repr(a)
            for a in out_node.args[0]]
    flops = [gemm_flops(n) for n in nodes if n.op == "call_function"]
    return Region(id=rid, stage=stage, executor=ex_name, ops=ops, input_shapes=ins,
                  output_shapes=outs, graph_id=graph_id, gemm_flops=sum(f for f, _ in flops),
                  fp8_gemm_flops=sum(f for f, fp8 in flops if fp8))


def gemm_flops(node: fx.Node) -> tuple[int, bool]:
    """(matmul FLOPs of `node`, whether they run in fp8); (0, False) for other ops."""
    aten = torch.ops.aten
    shapes = [tuple(node_value(a).shape) if isinstance(a, fx.Node) and isinstance(node_value(a), torch.Tensor)
              else None for a in node.args]
    try:
        if node.target in (aten.mm.default, aten.addmm.default):
            a, b = shapes[-2], shapes[-1]
            return 2 * a[0] * a[1] * b[1], False
        if node.target is aten.bmm.default:
            a, b = shapes
            return 2 * a[0] * a[1] * a[2] * b[2], False
        if getattr(node.target, "namespace", None) == "pipeline_te":
            fp8 = bool(node.args[3])
            if node.target._opname == "linear":
                x, w = shapes[0], shapes[1]
                return 2 * (math.prod(x) // x[-1]) * x[-1] * w[0], fp8
            dy = shapes[0]
            k = node_value(node)[0].shape[-1]
            return 4 * math.prod(dy) * k, fp8
    except (TypeError, IndexError):  # symbolic sizes: not counted
        pass
    return 0, False


def _set_region_values(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_module":
            sub = gm.get_submodule(node.target).source
            out = list(sub.graph.nodes)[-1].args[0]
            node.meta["val"] = tuple(node_value(a) if isinstance(a, fx.Node) else a for a in out)


def _short(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns = "" if target.namespace == "aten" else f"{target.namespace}."
        return f"{ns}{target._opname}"
    return getattr(target, "__name__", str(target))
