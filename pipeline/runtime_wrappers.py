"""Runtime wrappers, chained as AOTAutograd's `CompilerWrapper`s (docs/design.md): `pre_compile` edits what compiles
(first to last), `post_compile` wraps the callable (the first outermost), `metadata()` must match a cache entry's."""

from typing import Callable, Optional

import torch
import torch.fx as fx

from ir import Trace

from .boxed import boxed
from .model_state import rewrite


class RuntimeWrapper:
    """One step of the chain; the base class changes nothing."""

    def pre_compile(self, trace: Trace, example_inputs: list) -> tuple[Trace, list]:
        return trace, example_inputs

    def post_compile(self, fn: Callable) -> Callable:
        return fn

    def metadata(self) -> dict:
        return {}


class ModelTransformInputs(RuntimeWrapper):
    """Model-changing transforms (quantize, fsdp): pre_compile rewrites the trace to read the transforms' tensors,
    post_compile feeds them for the original parameters. Metadata: each captured input's replaced qualname or None."""

    def __init__(self, replaced: dict, qualnames: Optional[list] = None):
        self.replaced, self.qualnames = replaced, qualnames

    def pre_compile(self, trace, example_inputs):
        self.qualnames = [s.qualname if s.kind == "parameter" and s.qualname in self.replaced else None
                          for s in trace.inputs]
        return rewrite(trace, list(example_inputs), self.replaced)

    def post_compile(self, fn):
        plan = [None if q is None else self.replaced[q] for q in self.qualnames]

        def run(*args):  # `r.tensors` read at each call: loading a checkpoint may swap them
            return fn(*(t for a, r in zip(args, plan) for t in ((a,) if r is None else r.tensors.values())))
        return run

    def metadata(self) -> dict:
        return {"qualnames": self.qualnames}


class SeparateMutatedInputs(RuntimeWrapper):
    """Dynamo guards that no two inputs are one tensor, not that they do not overlap: a graph compiled for separate
    tensors that writes one in place would read stale values through an overlapping view of it (torch.compile
    recompiles for such aliasing; this refuses it). Each call checks that an input the graph writes shares no bytes
    with another; metadata: the positions checked."""
    def pre_compile(self, trace, example_inputs):
        self.users = {i: s.name for i, s in enumerate(trace.inputs)
                      if s.kind == "user_input" and isinstance(example_inputs[i], torch.Tensor)}
        nodes = trace.placeholders()  # a fake input written while Dynamo traced has a new version
        self.written = [i for i in self.users if getattr(nodes[i].meta.get("val"), "_version", 0)]
        return trace, example_inputs

    def post_compile(self, fn):
        pairs = [(i, j) for i in self.written for j in self.users if j != i]

        def run(*args):
            for i, j in pairs:
                if _overlap(args[i], args[j]):
                    raise RuntimeError(f"pipeline: inputs {self.users[i]} and {self.users[j]} share memory, and the graph, "
                                       "compiled for separate tensors, writes the first in place: pass a .clone()")
            return fn(*args)
        return run if pairs else fn

    def metadata(self) -> dict:
        return {"users": list(self.users.items()), "written": self.written}


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' byte spans intersect (conservative: strided views may interleave without touching)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = (_byte_span(t) for t in (a, b))
    return a0 < b1 and b0 < a1


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset() * t.element_size(), (last + 1) * t.element_size()


class BoxedStage(RuntimeWrapper):
    """A compiled stage that frees each input after its last use (`boxed`); `stored`: its cached code. No metadata."""

    def __init__(self, stored: Optional[tuple] = None):
        self.stored = stored

    def post_compile(self, gm: fx.GraphModule):
        return boxed(gm, self.stored)


def graph_wrappers(state) -> list[RuntimeWrapper]:
    return [SeparateMutatedInputs()] + ([ModelTransformInputs(state.config.replaced)] if state.config.replaced else [])


def pre_compile_all(wrappers: list[RuntimeWrapper], trace: Trace, example_inputs: list, record) -> tuple[Trace, list]:
    for w in wrappers:
        new, example_inputs = w.pre_compile(trace, example_inputs)
        if new is not trace:
            trace = record.add_trace(new)
    return trace, example_inputs


def post_compile_all(wrappers: list[RuntimeWrapper], fn: Callable) -> Callable:
    for w in reversed(wrappers):
        fn = w.post_compile(fn)
    return fn


def wrapper_metadata(wrappers: list[RuntimeWrapper]) -> list[tuple[str, dict]]:
    return [(type(w).__name__, w.metadata()) for w in wrappers]
