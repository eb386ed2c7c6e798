"""A stage's graph as bytes, for the warm start: torch's GraphPickler, minus what costs and is unused
(docs/cache.md). A plain fake tensor (static sizes, strided, no autograd, no subclass) is stored as its
sizes, strides, offset, dtype, device and an id of its storage, so tensors that shared memory share it
again after loading (dispatch's donation decisions read that); anything else goes through torch's own
description. Debug metadata is left out. What the warm start stores is an execution trace's module
before its regions were built (`executors.plan.unbuilt`): identical regions share one graph."""

import contextlib

import torch
import torch.fx as fx
from torch._subclasses import FakeTensor, FakeTensorMode
from torch.utils._mode_utils import no_dispatch
from torch.fx._graph_pickler import GraphPickler, Options
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.multiprocessing.reductions import StorageWeakRef

# Node metadata kept for debugging only: about half of a stage's pickled size, nothing dispatch reads.
DEBUG_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "fwd_nn_module_stack",
              "fwd_source_fn_stack", "from_node", "torch_fn")


def dumps(gm: fx.GraphModule) -> bytes:
    """`gm` and the graph modules it calls (a submodule called under several names is stored once)."""
    with contextlib.ExitStack() as stack:
        for graph in {gm.graph, *(sub.graph for sub in gm._modules.values())}:
            stack.enter_context(_without_debug_meta(graph))
        return _StagePickler.dumps(gm, Options(ops_filter=None))


def loads(data: bytes) -> fx.GraphModule:
    """The module `dumps` stored, its submodules (lazily generated) graph modules again."""
    gm = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    made: dict[int, fx.GraphModule] = {}  # submodules stored once stay shared
    for name, sub in list(gm._modules.items()):  # not named_children(): it yields a shared module once
        if id(sub) not in made:
            made[id(sub)] = _LazyGraphModule(sub, sub.graph, class_name=name)
        gm._modules[name] = made[id(sub)]
    return _LazyGraphModule(gm, gm.graph, class_name="executed")


class _StagePickler(GraphPickler):
    def __init__(self, file, options=None):
        super().__init__(file, options)
        self._storage_ids: dict[StorageWeakRef, int] = {}

    def reducer_override(self, obj):
        if type(obj) is FakeTensor and _plain(obj):
            storage = obj.untyped_storage()
            sid = self._storage_ids.setdefault(StorageWeakRef(storage), len(self._storage_ids))
            return _fake_tensor, (self._unpickle_state, sid, storage.nbytes(), tuple(obj.shape), obj.stride(),
                                  obj.storage_offset(), obj.dtype, obj.device)
        return super().reducer_override(obj)


def _plain(t: FakeTensor) -> bool:
    if t.layout != torch.strided or t.requires_grad or t.is_conj() or t.is_neg():
        return False  # checked before its storage is asked for: a sparse tensor has none
    nbytes = t.untyped_storage().nbytes()
    return all(type(s) is int for s in (*t.shape, *t.stride(), t.storage_offset(), nbytes)) \
        and nbytes % t.element_size() == 0


def _fake_tensor(state, sid: int, nbytes: int, shape, stride, offset: int, dtype, device) -> FakeTensor:
    """A fake tensor over storage `sid` of this load (made on first use), as it was pickled."""
    buffers = state.__dict__.setdefault("pipeline_storages", {})
    with no_dispatch():  # meta tensors made directly, then wrapped, as torch's own loader does
        if sid not in buffers:
            buffers[sid] = torch.empty((nbytes,), dtype=torch.uint8, device="meta")
        return FakeTensor(state.fake_mode, buffers[sid].view(dtype).as_strided(shape, stride, offset), device)


@contextlib.contextmanager
def _without_debug_meta(graph: fx.Graph):
    """The graph's nodes without `DEBUG_META` while pickling; their metadata is put back after."""
    kept = {node: node.meta for node in graph.nodes}
    try:
        for node, meta in kept.items():
            node.meta = {k: v for k, v in meta.items() if k not in DEBUG_META}
        yield
    finally:
        for node, meta in kept.items():
            node.meta = meta
