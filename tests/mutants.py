"""Mutants of the pipeline, for `make test-mutants` (scripts/mutants.py): a pytest plugin that, when
`PIPELINE_MUTANT=<name>` is set, monkeypatches one deliberate bug into the pipeline for the whole
test session. A suite that still passes under a mutant could not see that bug.

    PIPELINE_MUTANT=uncompiled .venv/bin/python -m pytest -p tests.mutants tests/test_dispatch.py

The bugs are patched in memory, never written to the source files, so the tree stays as it is.
"""
from __future__ import annotations

import os

import pytest


def uncompiled():
    """The backend returns the captured graph as it is: nothing lowered, dispatched or compiled."""
    from pipeline.compiler import PipelineBackend
    PipelineBackend.__call__ = lambda self, gm, example_inputs: gm.forward


def all_to_torch():
    """The dispatcher ignores the listed executors: every op goes to the `torch` fallback."""
    from executors import plan
    assign = plan.assign
    plan.assign = lambda gm, executors, fallback: assign(gm, [], fallback)


def passes_skipped():
    """No trace pass runs (before autodiff, on the joint graph, after autodiff)."""
    from pipeline.compiler import PipelineBackend
    PipelineBackend._run_passes = lambda self, where, trace, record: trace


def transposed_results():
    """Every region returns its 2-D+ tensor outputs transposed (the last two dims): a region runner
    that hands back the wrong layout of the right data."""
    import torch
    from executors.compiled_region import CompiledRegion
    forward, call_boxed = CompiledRegion.forward, CompiledRegion.call_boxed

    def transpose(out):
        if isinstance(out, torch.Tensor):
            return out.transpose(-1, -2) if out.dim() >= 2 else out
        if isinstance(out, (tuple, list)):
            return type(out)(transpose(o) for o in out)
        return out

    boxed = set()  # ids of regions inside call_boxed: that call transposes, not a forward inside it

    def mutated_forward(self, *args):
        out = forward(self, *args)
        return out if id(self) in boxed else transpose(out)

    def mutated_call_boxed(self, args):
        boxed.add(id(self))
        try:
            return transpose(call_boxed(self, args))
        finally:
            boxed.discard(id(self))

    CompiledRegion.forward = mutated_forward
    CompiledRegion.call_boxed = mutated_call_boxed


MUTANTS = {f.__name__: f for f in (uncompiled, all_to_torch, passes_skipped, transposed_results)}


def pytest_configure(config):
    name = os.environ.get("PIPELINE_MUTANT")
    if not name:
        return
    if name not in MUTANTS:
        raise pytest.UsageError(f"PIPELINE_MUTANT={name!r}: no such mutant (known: {', '.join(MUTANTS)})")
    MUTANTS[name]()


def pytest_report_header(config):
    name = os.environ.get("PIPELINE_MUTANT")
    if name:
        return f"pipeline mutant: {name} ({MUTANTS[name].__doc__.splitlines()[0]})"
