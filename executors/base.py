"""The `Executor` protocol: what an executor claims and how it compiles a region.

An executor is mostly a table: which ops it claims (`claims_table`, a `ClaimTable`, or its own
`claims_op`), plus `compile_region`, which turns a region's ATen graph into a callable. `kind` is
"fusion" (takes whole regions of contiguous claimed ops) or "operator" (takes single ops).

Everything else is optional and grouped by capability (`Cacheable`, `PerModel`, `PreparesGraph`,
below); an executor opts into one by subclassing it (`class MyFuser(Cacheable, Executor)`) and
overriding its hooks. `Executor` documents each hook and keeps a neutral default for it, so an
executor overriding them directly works the same.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from .claims import ClaimTable
# Re-exported for the modules that import them from here; new code imports them from where they live.
from .artifact_files import artifact_files_dir, set_artifact_files_root  # noqa: F401
from .graph_utils import (computes_nothing, donated_inputs, is_symbolic_glue, keep_promised_strides,  # noqa: F401
                          meta_strides_unreliable, op_name, promised_strides)

RegionFn = Callable[..., tuple]


class RegionDeclined(Exception):
    """Raised by `compile_region` when an executor chooses not to take a region (not an error):
    the region goes to the next executor that claims it, with the message as the reason."""


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
    """Base class of executors. Subclasses set `name`, `kind`, `claims_table` (or override
    `claims_op`), `compile_region` and, when they need something installed, `unavailable_reason`."""

    name: str = "executor"
    kind: str = "fusion"  # "fusion" | "operator"
    claims_table: Optional[ClaimTable] = None  # read by the default `claims_op`
    # True when compiled regions may return one of their inputs where the trace has a fresh tensor
    # (a clone compiled to an alias): donation then treats their outputs as sharing inputs' memory.
    outputs_may_alias_inputs: bool = False
    # False when the executor's kernels cannot be recorded in a CUDA graph (host syncs, allocations
    # kept across calls): stages with its regions then run without CUDA graphs.
    cuda_graphs_safe: bool = True

    def unavailable_reason(self) -> str | None:
        """None when the executor can run here; otherwise why not (what is missing, how to get it)."""
        return None

    def available(self) -> Availability:
        """Truthy when the executor can run here; otherwise falsy, with the reason as `.reason`."""
        return Availability(self.unavailable_reason())

    def claims_op(self, op, node: fx.Node) -> bool:
        """Whether this executor runs `op` (an OpOverload or a Python callable) for `node` as it
        stands. By default: what `claims_table` says."""
        if self.claims_table is None:
            raise NotImplementedError(f"executor {self.name!r}: set claims_table or override claims_op")
        return self.claims_table.claims(op, node)

    def claims(self, node: fx.Node) -> bool:
        """Whether this executor runs the call_function `node` as it stands."""
        return node.op == "call_function" and self.claims_op(node.target, node)

    def library_ops(self) -> set:
        """Ops this executor runs as calls into library kernels (cuBLAS, cuDNN) rather than fusing
        them: the borders of the fusible islands it shares with other fusion executors."""
        return set()

    def flops(self, node: fx.Node) -> tuple[int, bool] | None:
        """(matmul FLOPs of `node`, whether they run in fp8) for ops of this executor's own whose
        arguments only it knows (TE's custom ops); None for any other op (the core counts aten's)."""
        return None

    def compile_region(self, gm: fx.GraphModule, example_inputs: Sequence) -> RegionFn:
        """Compiles a region (an ATen graph returning a tuple) into `fn(*args) -> tuple`.

        `example_inputs` are fake tensors (and SymInts) with the inputs' metadata. Raise to decline:
        the dispatcher then gives the region to the next executor and records the message.
        """
        raise NotImplementedError

    # -- the capabilities' hooks, with their neutral defaults: `Cacheable` --------------------------
    def cache_token(self) -> str:
        """What, besides a region's graph, its compiled code depends on (options, library versions).
        Part of every cache key; override when an executor has options."""
        return f"{type(self).__module__}.{type(self).__qualname__}"

    def artifact_unsupported_reason(self, gm: fx.GraphModule, example_inputs: Sequence) -> str | None:
        """None when `save_region`/`load_region` can store and rebuild this region; otherwise why not."""
        return f"executor {self.name!r} has no serializable artifact (it does not implement save_region/load_region)"

    def save_region(self, fn: RegionFn) -> bytes:
        """The bytes `load_region` rebuilds the compiled region `fn` from (in another process)."""
        raise NotImplementedError

    def load_region(self, data: bytes, gm: fx.GraphModule, example_inputs: Sequence) -> RegionFn:
        """The compiled region from `save_region`'s bytes; `gm` and `example_inputs` as in
        `compile_region`. Raise when the bytes do not fit: the region is compiled instead. The bytes
        were authenticated as this user's; files they need on disk go under
        `executors.artifact_files.artifact_files_dir`."""
        raise NotImplementedError

    # -- `PerModel` -------------------------------------------------------------------------------
    def for_model(self) -> "Executor":
        """The instance one jitted model uses: executors keeping per-model state return a fresh copy;
        stateless ones return themselves."""
        return self

    def before_call(self) -> None:
        """Runs at the start of each call (e.g. to update fp8 scales from the last amaxes). It costs a
        Python call per step, so the pipeline skips executors that leave it as `Executor`'s."""

    def extra_state(self) -> dict[str, torch.Tensor]:
        """State this executor keeps for the model, as state-dict entries (`<module>._extra_state.*`)."""
        return {}

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> set[str]:
        """Takes the entries of `state` this executor owns; returns their keys."""
        return set()

    # -- `PreparesGraph` --------------------------------------------------------------------------
    def passes_before_prepare(self) -> tuple[str, ...]:
        """Names of built-in passes (`transforms.<name>`) the pipeline runs on the captured trace just
        before `prepare` (TE's `group_linears`): an executor needing a rewrite contributes it by name
        instead of importing `transforms`."""
        return ()

    def prepare(self, trace):
        """Before autodiff, on the captured trace: swap ops this executor must receive whole (e.g. a
        linear with its own backward) for custom ops. Returns (trace, [(op, why it was left alone)])."""
        return trace, []

    def decompositions_before_partition(self) -> dict:
        """Decompositions (op -> fn) to apply while AOTAutograd traces the joint graph, for ops this
        executor would decompose anyway: the min-cut partitioner then sees their parts and can
        recompute a cheap one in the backward instead of saving a large output."""
        return {}

    def __repr__(self) -> str:
        return f"<executor {self.name} ({self.kind})>"


class Cacheable(Executor):
    """An executor whose compiled regions the artifact cache can store and rebuild in another process:
    it implements `save_region` and `load_region`, and puts its options into `cache_token`."""

    def artifact_unsupported_reason(self, gm: fx.GraphModule, example_inputs: Sequence) -> str | None:
        return None


class PerModel(Executor):
    """An executor with hooks around one jitted model: its own instance (`for_model`: TE's fp8 scaling
    history), a hook at the start of each call (`before_call`), and entries in the model's state dict."""


class PreparesGraph(Executor):
    """An executor that sees the captured graph before autodiff (`passes_before_prepare`, `prepare`),
    or the joint graph's tracing (`decompositions_before_partition`)."""


def library_version(module: str) -> str:
    """`module`'s version and the GPU's compute capability, for the `cache_token` of an executor
    whose compiled code depends on both ("none" where missing)."""
    import importlib
    try:
        version = getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:
        version = "none"
    sm = torch.cuda.get_device_capability() if torch.cuda.is_available() else "none"
    return f"{module}={version} sm={sm}"


def cuda_library_missing(what: str, modules: Sequence[str], install: str) -> str | None:
    """None when every module imports and a CUDA GPU is present; otherwise why not (an executor's
    `unavailable_reason` for a CUDA-only library)."""
    import importlib
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:
            return f"{module} does not import ({type(e).__name__}: {str(e)[:200]}); {install}"
    if not torch.cuda.is_available():
        return f"{what} needs a CUDA GPU"
    return None
