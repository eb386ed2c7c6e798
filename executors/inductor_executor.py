"""The `inductor` executor: compiles each region it is given with TorchInductor.

Regions are already functional ATen graphs, so they go straight to `compile_fx_inner` (the entry
Inductor itself uses after AOTAutograd): C++/OpenMP kernels on the CPU, Triton kernels on CUDA.
It claims the ops Inductor has a lowering or a decomposition for.
"""
from __future__ import annotations

import contextlib
import functools
import shutil
from typing import Sequence

import torch
import torch.fx as fx

from ir import node_value

from .base import Executor, is_symbolic_glue, restrided, static_stride


class InductorExecutor(Executor):
    name = "inductor"
    kind = "fusion"

    def __init__(self, fallback_random: bool = False):
        self.fallback_random = fallback_random

    def options(self, *, fallback_random: bool = False) -> "InductorExecutor":
        """This executor with Inductor options. `fallback_random=True` runs random ops (dropout)
        with eager's kernels, so they draw the same numbers as eager under the same seed; the
        default (False, as in torch.compile) generates them in Inductor's own kernels."""
        return InductorExecutor(fallback_random=fallback_random)

    def unavailable_reason(self) -> str | None:
        try:
            import torch._inductor.compile_fx  # noqa: F401
        except Exception as e:  # pragma: no cover - torch builds without inductor
            return f"torch._inductor does not import: {e}"
        if not torch.cuda.is_available() and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
            return "Inductor on the CPU needs a C++ compiler (g++ or clang++) on PATH"
        return None

    def claims_op(self, op, node: fx.Node) -> bool:
        if is_symbolic_glue(op):
            return True
        return op in _lowerings() or op in _decompositions(self.fallback_random)

    def compile_region(self, gm: fx.GraphModule, example_inputs: Sequence):
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx_inner

        with config.patch(fallback_random=self.fallback_random):
            decomposed = _inductor_decomposed(gm, example_inputs)
        # No channels-last layout choices of Inductor's own: other regions consume these outputs
        # with the strides the trace promises.
        with config.patch(fallback_random=self.fallback_random, layout_optimization=False):
            compiled = compile_fx_inner(decomposed, list(example_inputs))
        restride = _mismatched_strides(gm, _static_strides(getattr(compiled, "output_strides", None)))

        def run(*args):
            outs = list(compiled(list(args)))
            for i, stride in restride:
                outs[i] = restrided(outs[i], stride)
            return tuple(outs)
        return run


def _static_strides(strides):
    """Inductor's output strides (printed expressions) as ints; None where one is symbolic."""
    if not strides:
        return None
    out = []
    for stride in strides:
        try:
            out.append(None if stride is None else tuple(int(s) for s in stride))
        except (TypeError, ValueError):
            out.append(None)
    return out


def _mismatched_strides(region: fx.GraphModule, actual) -> list[tuple[int, tuple[int, ...]]]:
    """(output index, promised stride) for each output Inductor lays out differently from what the
    region's trace promises; those outputs are copied into the promised layout when they run."""
    if not actual:
        return []
    promised = region.graph.find_nodes(op="output")[0].args[0]
    out = []
    for i, (node, got) in enumerate(zip(promised, actual)):
        val = node_value(node) if isinstance(node, fx.Node) else None
        want = static_stride(val)
        if want is not None and got is not None and tuple(got) != want and val.numel() > 1:
            out.append((i, want))
    return out


def _inductor_decomposed(gm: fx.GraphModule, example_inputs: Sequence) -> fx.GraphModule:
    """The region re-traced with Inductor's own decompositions, which `compile_fx_inner` expects
    to have run (inside torch.compile, AOTAutograd applies them)."""
    from torch._guards import detect_fake_mode
    from torch._inductor import config
    from torch.fx.experimental.proxy_tensor import make_fx

    fake_mode = detect_fake_mode(list(example_inputs))
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        return make_fx(gm, decomposition_table=_decompositions(config.fallback_random),
                       tracing_mode="real")(*example_inputs)


@functools.cache
def _lowerings():
    from torch._inductor.lowering import lowerings
    return lowerings


@functools.cache
def _decompositions(fallback_random: bool):
    from torch._inductor import config
    from torch._inductor.decomposition import select_decomp_table
    with config.patch(fallback_random=fallback_random):
        return select_decomp_table()


inductor_executor = InductorExecutor()
