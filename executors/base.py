"""The `Executor` protocol: what an executor claims and how it compiles a region.

An executor is mostly a table: which ops it claims (`claims`), plus `compile_region`, which turns a
region's ATen graph into a callable. `kind` is "fusion" (takes whole regions of contiguous claimed
ops) or "operator" (takes single ops).
"""
from __future__ import annotations

import operator

from typing import Callable, Sequence

import torch
import torch.fx as fx

from ir import node_value

RegionFn = Callable[..., tuple]


class RegionDeclined(Exception):
    """Raised by `compile_region` when an executor chooses not to take a region (not an error):
    the region goes to the next executor that claims it, with the message as the reason."""


class Executor:
    """Base class of executors. Subclasses set `name`, `kind`, and override `claims_op`,
    `compile_region` and, when they need something installed, `unavailable_reason`."""

    name: str = "executor"
    kind: str = "fusion"  # "fusion" | "operator"
    # True when compiled regions may return one of their inputs where the trace has a fresh tensor
    # (a clone compiled to an alias): donation then treats their outputs as sharing inputs' memory.
    outputs_may_alias_inputs: bool = False
    # False when the executor's kernels cannot be recorded in a CUDA graph (host syncs, allocations
    # kept across calls): stages with its regions then run without CUDA graphs.
    cuda_graphs_safe: bool = True

    def unavailable_reason(self) -> str | None:
        """None when the executor can run here; otherwise why not (what is missing, how to get it)."""
        return None

    def available(self) -> tuple[bool, str | None]:
        """(True, None), or (False, the reason)."""
        reason = self.unavailable_reason()
        return reason is None, reason

    def claims_op(self, op, node: fx.Node) -> bool:
        """Whether this executor runs `op` (an OpOverload or a Python callable) for `node` as it stands."""
        raise NotImplementedError

    def claims(self, node: fx.Node) -> bool:
        """Whether this executor runs the call_function `node` as it stands."""
        return node.op == "call_function" and self.claims_op(node.target, node)

    def library_ops(self) -> set:
        """Ops this executor runs as calls into library kernels (cuBLAS, cuDNN) rather than fusing
        them: the borders of the fusible islands it shares with other fusion executors."""
        return set()

    def for_model(self) -> "Executor":
        """The instance one jitted model uses. Executors that keep per-model state (TE's fp8 scaling
        history) return a fresh copy; stateless ones return themselves."""
        return self

    def before_call(self) -> None:
        """Runs at the start of every call of a jitted model (e.g. to update fp8 scales from the
        previous step's amaxes). Override only when needed: it costs a Python call per step."""

    def extra_state(self) -> dict[str, torch.Tensor]:
        """State this executor keeps for the model, as state-dict entries (`<module>._extra_state.*`)."""
        return {}

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> set[str]:
        """Takes the entries of `state` this executor owns; returns their keys."""
        return set()

    def decompositions_before_partition(self) -> dict:
        """Decompositions (op -> fn) to apply while AOTAutograd traces the joint graph, for ops this
        executor would decompose anyway: the min-cut partitioner then sees their parts and can
        recompute a cheap one in the backward instead of saving a large output."""
        return {}

    def prepare(self, trace):
        """Before autodiff, on the captured trace: swap ops this executor must receive whole (e.g. a
        linear with its own backward) for custom ops. Returns (trace, [(op, why it was left alone)])."""
        return trace, []

    def compile_region(self, gm: fx.GraphModule, example_inputs: Sequence) -> RegionFn:
        """Compiles a region (an ATen graph returning a tuple) into `fn(*args) -> tuple`.

        `example_inputs` are fake tensors (and SymInts) with the inputs' metadata. Raise to decline:
        the dispatcher then gives the region to the next executor and records the message.
        """
        raise NotImplementedError

    # -- the compiled-artifact cache -------------------------------------------------------------
    def cache_token(self) -> str:
        """What, besides a region's graph, its compiled code depends on (options, library versions).
        Part of every cache key; override when an executor has options."""
        return f"{type(self).__module__}.{type(self).__qualname__}"

    def artifact_unsupported_reason(self, gm: fx.GraphModule, example_inputs: Sequence) -> str | None:
        """None when `save_region`/`load_region` can store and rebuild this region; otherwise why
        not. The default opts out: an executor caches only when it implements both."""
        return f"executor {self.name!r} has no serializable artifact (it does not implement save_region/load_region)"

    def save_region(self, fn: RegionFn) -> bytes:
        """The bytes `load_region` rebuilds the compiled region `fn` from (in another process)."""
        raise NotImplementedError

    def load_region(self, data: bytes, gm: fx.GraphModule, example_inputs: Sequence) -> RegionFn:
        """The compiled region from `save_region`'s bytes; `gm` and `example_inputs` as in
        `compile_region`. Raise when the bytes do not fit: the region is compiled instead. The bytes
        were authenticated as this user's; files they need on disk go under `artifact_files_dir`."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<executor {self.name} ({self.kind})>"


_artifact_files_root: list[str] = []  # set by the pipeline's cache once it has checked its root


def set_artifact_files_root(path: str | None) -> None:
    """Where executors keep the files of cached artifacts: a directory only this user can write
    (the pipeline's cache checks it and calls this), or None while the cache is off."""
    _artifact_files_root[:] = [path] if path else []


def artifact_files_dir(name: str) -> str | None:
    """`<root>/<name>` (made 0700) for an executor's files that a cached artifact loads (Inductor's
    kernels): only this user can write there, so what was checked before loading stays as checked.
    None while the cache is off; then an executor uses its library's own directories."""
    if not _artifact_files_root:
        return None
    import os
    import stat
    path = os.path.join(_artifact_files_root[0], name)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{path} is not a directory only you can write; remove it")
    return path


def static_stride(value) -> tuple[int, ...] | None:
    """A fake or real tensor's stride when every entry is a plain int, else None."""
    if isinstance(value, torch.Tensor) and all(isinstance(s, int) for s in value.stride()):
        return tuple(value.stride())
    return None


def restrided(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """`t` copied into the layout `stride` (what a region's trace promised its consumers)."""
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


def promised_strides(region: fx.GraphModule) -> list[tuple[int, tuple[int, ...]]]:
    """(output index, stride) for each output of `region` whose trace promises a static layout: what
    other regions were compiled against."""
    outs = region.graph.find_nodes(op="output")[0].args[0]
    strides = [(i, static_stride(node_value(n))) for i, n in enumerate(outs) if isinstance(n, fx.Node)]
    return [(i, stride) for i, stride in strides if stride is not None]


def keep_promised_strides(outs: list, promised: list[tuple[int, tuple[int, ...]]]) -> list:
    """`outs` (in place) with each output laid out differently from its promise copied into it."""
    for i, stride in promised:
        if outs[i].stride() != stride and outs[i].numel() > 1:  # one element: any stride is the same
            outs[i] = restrided(outs[i], stride)
    return outs


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


def is_symbolic_glue(target) -> bool:
    """Python-level arithmetic on sizes (operator.mul on SymInts, sym_size, ...)."""
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace == "aten" and target._opname.startswith("sym_")
    module = getattr(target, "__module__", "") or ""
    return module in ("_operator", "operator", "math") or getattr(target, "__name__", "").startswith("sym_")


_VIEW_LIKE = (torch.ops.aten.detach.default, torch.ops.aten._unsafe_view.default)


def computes_nothing(target) -> bool:
    """Views, tuple elements and shape arithmetic: ops that cost nothing wherever they run."""
    if target is operator.getitem or is_symbolic_glue(target):
        return True
    return isinstance(target, torch._ops.OpOverload) and (target.is_view or target in _VIEW_LIKE)


def op_name(target) -> str:
    """An op's short name: `mul`, `pipeline_te.linear`, `getitem`."""
    if isinstance(target, torch._ops.OpOverload):
        ns = "" if target.namespace == "aten" else f"{target.namespace}."
        return f"{ns}{target._opname}"
    return getattr(target, "__name__", str(target))


_CPU_FFT = ("_fft_r2c", "_fft_c2c", "_fft_c2r")


def meta_strides_unreliable(node: fx.Node) -> bool:
    """Whether `node`'s fake (meta) output strides may differ from what its real kernel produces.
    One known case: the FFT ops on the CPU before torch 2.13 (torch.compile fails on them the same
    way). Such ops run on `torch`, whose region copies their outputs into the promised layout."""
    if not (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target.namespace == "aten" and node.target._opname in _CPU_FFT):
        return False
    from torch.torch_version import TorchVersion
    if TorchVersion(torch.__version__) >= "2.13":
        return False
    x = node_value(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
    return isinstance(x, torch.Tensor) and x.device.type == "cpu"


def donated_inputs(gm: fx.GraphModule) -> list[int]:
    """Positions of a region's inputs that nothing reads after it (saved activations in a backward,
    marked by the dispatcher): an executor may reuse their memory for its own buffers."""
    return [i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder") if n.meta.get("donated")]
