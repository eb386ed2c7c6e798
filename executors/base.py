"""The `Executor` protocol: what it claims (`claims_table` or `claims_op`), how it compiles a region (`compile_region`);
hooks by capability (`Cacheable`, `PerModel`, `PreparesGraph`) default neutrally (docs/executors.md)."""

import functools
import importlib
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from .claims import ClaimTable

RegionFn = Callable[..., tuple]


class RegionDeclined(Exception):
    """Raised by `compile_region` to decline a region (not an error): the next claiming executor takes it, told why."""


class Availability:
    """Whether an executor can run here: truthy when it can; falsy, with `.reason`, when not."""
    __slots__ = ("reason",)

    def __init__(self, reason: Optional[str] = None):
        self.reason = reason

    def __bool__(self) -> bool:
        return self.reason is None

    def __repr__(self) -> str:
        return "Availability(available)" if self else f"Availability(unavailable: {self.reason})"


class Executor:
    """Base class of executors: subclasses set `name`, `kind`, `claims_table` (or `claims_op`), `compile_region`."""

    name: str = "executor"
    kind: str = "fusion"  # "fusion" | "operator"
    claims_table: Optional[ClaimTable] = None  # read by the default `claims_op`
    outputs_may_alias_inputs: bool = False  # regions may return an input where the trace has a copy
    cuda_graphs_safe: bool = True  # False: its kernels cannot be recorded in a CUDA graph (host syncs)

    def unavailable_reason(self) -> str | None:
        """None when the executor can run here; otherwise why not (what is missing, how to get it)."""
        return None

    def available(self) -> Availability:
        return Availability(self.unavailable_reason())

    def claims_op(self, op, node: fx.Node) -> bool:
        """Whether this executor runs `op` for `node` as it stands; by default what `claims_table` says."""
        if self.claims_table is None:
            raise NotImplementedError(f"executor {self.name!r}: set claims_table or override claims_op")
        return self.claims_table.claims(op, node)

    def claims(self, node: fx.Node) -> bool:
        """Whether this executor runs the call_function `node` as it stands."""
        return node.op == "call_function" and self.claims_op(node.target, node)

    def library_ops(self) -> set:
        """Ops it runs as library kernels (cuBLAS, cuDNN), not fused: the borders of fusible islands."""
        return set()

    def flops(self, node: fx.Node) -> tuple[int, bool] | None:
        """(matmul FLOPs, whether in fp8) of its own ops (TE's custom ops); None for others (aten's are counted)."""
        return None

    def compile_region(self, gm: fx.GraphModule, example_inputs: Sequence) -> RegionFn:
        """Compiles a region (an ATen graph returning a tuple) into `fn(*args) -> tuple`; `example_inputs`
        are fake tensors (and SymInts). Raise to decline: the region goes to the next executor."""
        raise NotImplementedError

    def finish_region(self, fn: RegionFn) -> None:
        """Completes, before the region is stored or run, work `compile_region` left running (Inductor's
        kernels compile while the next regions do). Raising counts as a failed compile: the region falls back."""

    # -- the capabilities' hooks, with their neutral defaults: `Cacheable` --------------------------
    def cache_token(self) -> str:
        """What, besides a region's graph, its compiled code depends on (options, library versions)."""
        return f"{type(self).__module__}.{type(self).__qualname__}"

    def artifact_unsupported_reason(self, gm: fx.GraphModule, example_inputs: Sequence) -> str | None:
        """None when `save_region`/`load_region` can store and rebuild this region; otherwise why not."""
        return f"executor {self.name!r} has no serializable artifact (it does not implement save_region/load_region)"

    def save_region(self, fn: RegionFn) -> bytes:
        """The bytes `load_region` rebuilds the compiled region `fn` from (in another process)."""
        raise NotImplementedError

    def load_region(self, data: bytes, gm: fx.GraphModule, example_inputs: Sequence) -> RegionFn:
        """The compiled region from `save_region`'s (authenticated) bytes; raise when they do not fit:
        the region is compiled instead. Files they need on disk go under `artifact_files_dir`."""
        raise NotImplementedError

    # -- `PerModel` -------------------------------------------------------------------------------
    def for_model(self) -> "Executor":
        """The instance one jitted model uses: a fresh copy for executors keeping per-model state."""
        return self

    def before_call(self) -> None:
        """Runs before each call (e.g. new fp8 scales); a Python call per step, so skipped unless overridden."""

    def extra_state(self) -> dict[str, torch.Tensor]:
        """State this executor keeps for the model, as state-dict entries (`<module>._extra_state.*`)."""
        return {}

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> set[str]:
        """Takes the entries of `state` this executor owns; returns their keys."""
        return set()

    # -- `PreparesGraph` --------------------------------------------------------------------------
    def passes_before_prepare(self) -> tuple[str, ...]:
        """Names of `transforms` passes run just before `prepare` (TE's `group_linears`): executors don't import it."""
        return ()

    def prepare(self, trace):
        """Before autodiff, on the captured trace: swap ops this executor must receive whole (e.g. a
        linear with its own backward) for custom ops. Returns (trace, [(op, why it was left alone)])."""
        return trace, []

    def binding(self):
        """What `prepare` bound outside the graph (state its ops name), for `bind_again`; None: warm starts prepare."""
        return None

    def bind_again(self, binding) -> bool:
        """A warm start from an entry of this very graph: binds `binding` (from `binding()`) again instead of preparing,
        or returns False, changing nothing, when this model's state cannot give the same one."""
        return False

    def decompositions_before_partition(self) -> dict:
        """Decompositions (op -> fn) for AOTAutograd to apply to the joint graph, of ops this executor
        would decompose anyway, so the partitioner can recompute cheap parts instead of saving them."""
        return {}

    def joint_passes(self) -> tuple:
        """Trace passes (`Trace -> Trace`) for the joint graph before the partitioner, run where this executor is
        listed, before the user's joint passes: rewrites of ops it takes whole into ops it fuses better."""
        return ()

    def __repr__(self) -> str:
        return f"<executor {self.name} ({self.kind})>"


class Cacheable(Executor):
    """An executor whose compiled regions the artifact cache stores (`save_region`, `load_region`)."""

    def artifact_unsupported_reason(self, gm: fx.GraphModule, example_inputs: Sequence) -> str | None:
        return None


class RebuiltFromGraph(Cacheable):
    """A `Cacheable` executor compiling a cached region again from its graph (torch, TE; nvFuser cannot save one)."""

    def save_region(self, fn) -> bytes:
        return b""

    def load_region(self, data: bytes, gm: fx.GraphModule, example_inputs: Sequence):
        return self.compile_region(gm, example_inputs)


class PerModel(Executor):
    """An executor with state per jitted model (`for_model`, `before_call`, `extra_state`: TE's fp8 scaling)."""


class PreparesGraph(Executor):
    """An executor that sees the captured graph (`prepare`) or the joint graph's tracing (decompositions)."""


@functools.cache
def library_version(module: str) -> str:
    """`module`'s version and the GPU's compute capability, for an executor's `cache_token`."""
    try:
        version = getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:
        version = "none"
    sm = torch.cuda.get_device_capability() if torch.cuda.is_available() else "none"
    return f"{module}={version} sm={sm}"


def cuda_library_missing(what: str, modules: Sequence[str], install: str) -> str | None:
    """An executor's `unavailable_reason` for a CUDA-only library: None when every module imports and a GPU is here."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:
            return f"{module} does not import ({type(e).__name__}: {str(e)[:200]}); {install}"
    return None if torch.cuda.is_available() else f"{what} needs a CUDA GPU"
