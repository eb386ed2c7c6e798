"""The `nvfuser` executor: a region as one nvFuser `FusionDefinition` per input signature (docs/executors.md)."""

import warnings
from typing import Sequence

import torch
import torch.fx as fx

from ir import node_value

from . import nvfuser_kernel_store as kernel_store
from .base import RebuiltFromGraph, RegionDeclined, cuda_library_missing, library_version
from .graph_utils import computes_nothing, keep_promised_strides, promised_strides
from .loss_gradient import pointwise_loss_gradient
from .nvfuser_ops import CLAIMS, NO_NVFUSER_DTYPES, define_fusion as _define


class NvFuserExecutor(RebuiltFromGraph):
    name = "nvfuser"
    kind = "fusion"
    device = "cuda"  # where its kernels run (CPU tests of its claims set "cpu")
    outputs_may_alias_inputs = True  # nvFuser may make a copy (clone -> set) an alias of its input
    claims_table = CLAIMS  # the ops nvfuser_ops.py translates, with their checkers

    def unavailable_reason(self) -> str | None:
        return cuda_library_missing("nvFuser", ["nvfuser_direct"],
                                    "install nvFuser (pip install nvfuser-cu130-torch210) on a CUDA machine")

    def claims_op(self, op, node: fx.Node) -> bool:
        """What `claims_table` says, for a node whose tensors nvFuser can take (`takes_tensors_of`)."""
        return self.takes_tensors_of(node) and super().claims_op(op, node)

    def takes_tensors_of(self, node: fx.Node) -> bool:
        """Whether every tensor `node` reads or makes is on this executor's device, in a dtype nvFuser takes."""
        values = [node_value(a) for a in node.all_input_nodes] + [node_value(node)]
        tensors = [t for v in values for t in (v if isinstance(v, (tuple, list)) else [v])]
        return all(t.device.type == self.device and t.dtype not in NO_NVFUSER_DTYPES
                   for t in tensors if isinstance(t, torch.Tensor))

    def decompositions_before_partition(self) -> dict:
        """Log-softmax in parts, as for Inductor: the partitioner saves half-precision logits and two [tokens, 1] sums,
        not fp32 log-probabilities (1 GiB at 8192 tokens x 32000). `detach` stays whole: nvFuser would copy an alias."""
        from torch._decomp import get_decompositions
        return get_decompositions([torch.ops.aten._log_softmax.default])

    def joint_passes(self) -> tuple:
        return (pointwise_loss_gradient,)  # its NLL backward: no [tokens, vocab] buffer, no reduction

    def cache_token(self) -> str:
        return f"nvfuser {library_version('nvfuser_direct')} device={self.device}"

    def compile_region(self, gm: fx.GraphModule, example_inputs: Sequence):
        if all(computes_nothing(n.target) for n in gm.graph.nodes if n.op == "call_function"):
            raise RegionDeclined("nothing to compute (only views): eager views cost less than a fusion's launch")
        # Build and run once now, on zeros: a region nvFuser cannot translate or compile falls back, not failing a step
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        runner = _FusionRunner(gm)
        with unset_fake_temporarily():
            trial = [_zeros_like(v) for v in example_inputs]
            if all(t is not None for t in trial):
                runner.fusions[_key(trial)] = fd = _build(gm, trial)
                with kernel_store.compiling() as options:
                    fd.execute(trial, **options)
        return runner


class _FusionRunner:
    """Runs a region through nvFuser, one FusionDefinition per input signature."""

    def __init__(self, gm: fx.GraphModule):
        self.gm, self.promised = gm, promised_strides(gm)
        self.fusions: dict[tuple, object] = {}  # input signature (`_key`) -> its FusionDefinition

    def __call__(self, *args):
        if (fd := self.fusions.get(key := _key(args))) is None:
            try:
                fd = _build(self.gm, args)
                with kernel_store.compiling() as options:
                    outs = fd.execute(list(args), **options)
            except Exception as e:  # a new input signature nvFuser cannot take: run this one on torch
                warnings.warn(f"nvfuser: region falls back to torch for inputs {key}: {type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0][:200]}")
                fd = _EagerFusion(self.gm)
                outs = fd.execute(list(args))
            self.fusions[key] = fd
        else:
            outs = fd.execute(list(args))
        return tuple(keep_promised_strides(outs, self.promised))


class _EagerFusion:
    """Stands in for a fusion nvFuser could not build: runs the region's ATen graph."""

    def __init__(self, gm):
        self.gm = gm

    def execute(self, args, **_options):  # nvFuser's compile options mean nothing here
        return list(self.gm(*args))


def _key(args) -> tuple:
    return tuple(_signature(a) for a in args)


def _zeros_like(v):
    if isinstance(v, torch.Tensor):
        try:
            shape, stride = [int(s) for s in v.shape], [int(s) for s in v.stride()]
        except (TypeError, ValueError):
            return None
        return torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device).zero_()
    return v if isinstance(v, (int, float, bool)) else None


def _signature(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.dim(), tuple(s == 1 for s in a.shape), a.stride() if a.dim() else ())
    return type(a)


def _build(gm: fx.GraphModule, inputs: Sequence):
    """The FusionDefinition of region `gm` for inputs with the metadata of `inputs`."""
    from nvfuser_direct import FusionDefinition
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        return _shared(_define(FusionDefinition, gm, inputs))


_FUSIONS = []  # one LruFusionCache for the process, made on first use


def _shared(fd):
    """`fd` via nvFuser's LRU cache of compiled fusions, keyed by structure: identical layers' regions compile once."""
    try:
        if not _FUSIONS:
            from nvfuser_direct import LruFusionCache
            _FUSIONS.append(LruFusionCache(max_fusions=16384))
        return _FUSIONS[0](lambda: fd)()
    except Exception:  # an nvFuser without the cache: each definition compiles on its own
        return fd


nvfuser_executor = NvFuserExecutor()
