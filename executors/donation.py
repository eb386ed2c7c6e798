"""Donation: which of a region's inputs it may overwrite or free (AOTAutograd's donated buffers —
saved activations nothing reads after the backward — that this region reads last)."""

import operator
from typing import Optional, Sequence

import torch
import torch.fx as fx

from ir import node_value


def mark_donated_inputs(gm: fx.GraphModule, donated: Sequence[int], may_alias: set[str] = frozenset()) -> None:
    """Sets `meta["donated"]` on a region's placeholder when its stage input is donated, this region reads it (or a
    tensor sharing its memory) last, and no other of its inputs shares it. Memory is told apart by fake storages; a
    `may_alias` executor's region (it may return an input) gives its outputs all its inputs' storages."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    candidates = {inputs[i] for i in donated if i < len(inputs)}
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    memory: dict[fx.Node, set] = {}  # node -> the storages its tensor may live in
    for node in gm.graph.nodes:
        memory[node] = {own} if (own := _storage_of(node)) is not None else set()
        if node.op == "call_function" and node.target is operator.getitem:
            if (region := node.args[0]).op == "call_module" and region.meta.get("executor") in may_alias:
                for a in region.args:
                    memory[node] |= memory.get(a, set()) if isinstance(a, fx.Node) else set()
    last_read: dict = {}  # storage -> position of the last node reading a tensor in it
    for node, storages in memory.items():
        if node.users:
            for storage in storages:
                last_read[storage] = max(last_read.get(storage, -1), max(order[u] for u in node.users))
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        placeholders = [n for n in gm.get_submodule(node.target).graph.nodes if n.op == "placeholder"]
        for arg, placeholder in zip(node.args, placeholders):
            if arg not in candidates or not memory[arg]:
                continue
            (storage,) = memory[arg]  # a stage input lives in its own memory
            shared = any(storage in memory.get(other, ()) for other in node.args
                         if other is not arg and isinstance(other, fx.Node))
            if last_read[storage] == order[node] and not shared:
                placeholder.meta["donated"] = True


def _storage_of(node) -> Optional[object]:
    """An identity of the memory behind a node's tensor value (views share their base's), or None."""
    from torch.multiprocessing.reductions import StorageWeakRef
    value = node_value(node) if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return None
    try:
        return StorageWeakRef(value.untyped_storage())
    except Exception:  # a tensor without storage (a subclass, say): not donated
        return None


def donated_stage_inputs(executed: fx.GraphModule) -> list[int]:
    """The stage inputs some region of this execution trace may overwrite (`mark_donated_inputs`)."""
    inputs = {n: i for i, n in enumerate(n for n in executed.graph.nodes if n.op == "placeholder")}
    return sorted({inputs[arg] for node in executed.graph.nodes if node.op == "call_module"
                   for arg, p in zip(node.args, executed.get_submodule(node.target).source.graph.find_nodes(
                       op="placeholder")) if p.meta.get("donated") and arg in inputs})


def keeping_saved_tensors(fn, donated: Sequence[int], recorded: bool):
    """A backward stage `fn` whose regions overwrite the saved tensors at `donated`, safe to run again: a backward that
    keeps the graph (`retain_graph=True`) gives them copies. One recorded as a CUDA graph cannot copy: it refuses."""
    def run(args: list):
        if torch._C._autograd._get_current_graph_task_keep_graph():
            if recorded:
                raise RuntimeError("pipeline: backward(retain_graph=True) of a backward recorded as a CUDA graph that "
                                   "overwrites its saved activations: jit with cuda_graphs=False, or set "
                                   "torch._functorch.config.donated_buffer = False before the first call")
            for i in donated:
                args[i] = args[i].clone()
        return fn(args)
    run._boxed_call = True
    return run if donated else fn
