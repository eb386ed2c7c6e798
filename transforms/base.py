"""Trace passes: pure `Trace -> Trace` functions naming their stage (`STAGES`; docs/passes.md, "Writing a pass")."""

import dataclasses
from typing import Callable

from ir import Trace

STAGES = ("before_autodiff", "joint", "after_autodiff")


@dataclasses.dataclass(frozen=True)
class TracePass:
    """A pass and where it runs. Call it like the function it wraps."""
    fn: Callable[[Trace], Trace]
    runs_on: str = "after_autodiff"
    name: str = ""
    output_dtypes_may_change: bool = False  # e.g. mixed precision; shapes and count never may
    optional: bool = False  # an optimization: if it raises, the graph compiles without it (reason recorded)

    def __post_init__(self):
        if self.runs_on not in STAGES:
            raise ValueError(f"pass {self.name or self.fn!r}: runs_on must be one of {STAGES}, got {self.runs_on!r}")
        if not callable(self.fn):
            raise TypeError(f"a trace pass must be callable, got {self.fn!r}")
        if not self.name:
            object.__setattr__(self, "name", getattr(self.fn, "__name__", repr(self.fn)))

    def __call__(self, trace: Trace) -> Trace:
        return self.fn(trace)


def trace_pass(fn: Callable | None = None, *, runs_on: str = "after_autodiff", name: str = ""):
    """Makes a `TracePass`; usable as `@trace_pass` or `@trace_pass(runs_on="before_autodiff")`."""
    return (lambda f: TracePass(f, runs_on, name)) if fn is None else TracePass(fn, runs_on, name)


def pass_factory(fn: Callable) -> Callable:
    """Marks a function making a pass or transform (`fsdp`): listed uncalled in `transforms`, it is a clear error."""
    fn.makes_pass = True
    return fn


def _check_takes_one_trace(fn: Callable) -> None:
    import inspect
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin: nothing to check
        return
    try:
        signature.bind(object())
    except TypeError:
        raise TypeError(f"transforms: {getattr(fn, '__name__', fn)!r} must take one argument, the "
                        f"trace (signature {signature})") from None


def as_pass(obj) -> TracePass:
    """A `TracePass` for what the user listed in `transforms=[...]`; a bare function runs after autodiff."""
    if isinstance(obj, TracePass):
        return obj
    if getattr(obj, "makes_pass", False):
        raise TypeError(f"{obj.__name__} makes a transform: list {obj.__name__}(...) in transforms, "
                        f"not {obj.__name__} itself")
    if callable(obj):
        _check_takes_one_trace(obj)
        return TracePass(obj)
    raise TypeError(f"transforms must hold trace passes or functions Trace -> Trace, got {obj!r}")
