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

from .base import Executor, is_symbolic_glue


class InductorExecutor(Executor):
    name = "inductor"
    kind = "fusion"

    def __init__(self, fallback_random: bool = False):
        self.fallback_random = fallback_random

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
        return op in _lowerings() or op in _decompositions()

    def compile_region(self, gm: fx.GraphModule, example_inputs: Sequence):
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx_inner

        with config.patch(fallback_random=self.fallback_random):
            compiled = compile_fx_inner(_inductor_decomposed(gm, example_inputs), list(example_inputs))

        def run(*args):
            return tuple(compiled(list(args)))
        return run


def _inductor_decomposed(gm: fx.GraphModule, example_inputs: Sequence) -> fx.GraphModule:
    """The region re-traced with Inductor's own decompositions, which `compile_fx_inner` expects
    to have run (inside torch.compile, AOTAutograd applies them)."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    fake_mode = detect_fake_mode(list(example_inputs))
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        return make_fx(gm, decomposition_table=_decompositions(), tracing_mode="real")(*example_inputs)


@functools.cache
def _lowerings():
    from torch._inductor.lowering import lowerings
    return lowerings


@functools.cache
def _decompositions():
    from torch._inductor.decomposition import select_decomp_table
    return select_decomp_table()


inductor_executor = InductorExecutor()
