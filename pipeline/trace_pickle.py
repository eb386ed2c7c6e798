"""A stage's graph as bytes, for the warm start (docs/cache.md): its nodes in order, each made again by `create_node`
as it is read (arguments found by pickle's memo, not GraphPickler's costly node records); a fake tensor as its sizes,
strides, offset, dtype, device and storage id (shared memory is shared again: donation reads it); no debug metadata.
It stores an execution trace's module before its regions were built (`plan.unbuilt`): identical regions share one."""

import contextlib
import operator
import pickle

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
    return GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))


class _StagePickler(GraphPickler):
    def __init__(self, file, options=None):
        super().__init__(file, options)
        self._storage_ids, self._nodes_stored = {}, set()  # StorageWeakRef -> id; the nodes pickled so far

    def reducer_override(self, obj):
        if isinstance(obj, fx.GraphModule):  # its graph, then every node in order, then what they name
            named = {n.target: operator.attrgetter(n.target)(obj) for n in obj.graph.nodes
                     if n.op in ("call_module", "get_attr")}
            return _graph_module, (obj.graph, tuple(obj.graph.nodes), named, type(obj).__name__)
        if type(obj) is fx.Graph:
            return _graph, (obj._codegen,)
        if type(obj) is fx.Node:
            if not self._nodes_stored.issuperset(obj.all_input_nodes):
                raise pickle.PicklingError(f"node {obj.name} is stored before an input of it")
            self._nodes_stored.add(obj)
            return _node, (obj.graph, obj.op, obj.name, obj.target, obj.args, obj.kwargs, obj.type, obj.meta)
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


def _graph(codegen) -> fx.Graph:
    graph = fx.Graph()
    graph._codegen = codegen
    return graph


def _node(graph: fx.Graph, op: str, name: str, target, args, kwargs, type_, meta: dict) -> fx.Node:
    node = graph.create_node(op, target, args, kwargs, name, type_)  # names are unique: each comes back as it was
    node.meta = meta
    return node


def _graph_module(graph: fx.Graph, nodes: tuple, named: dict, class_name: str) -> fx.GraphModule:
    return _LazyGraphModule(named, graph, class_name=class_name)  # its code generated when first needed


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
