"""Groups assigned ops into cycle-free regions, one fx submodule per region.

Built on torch.fx's `CapabilityBasedPartitioner`, run once per executor: a fusion executor's ops
are merged into as few regions as cycle-freedom allows; an operator executor gets one region per op.
"""
from __future__ import annotations

import operator
from typing import Sequence

import torch.fx as fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner, Partition
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from .base import Executor


class _AssignedTo(OperatorSupportBase):
    def __init__(self, name: str):
        self.name = name

    def is_node_supported(self, submodules, node: fx.Node) -> bool:
        return node.op == "call_function" and node.meta.get("executor") == self.name


def partition(gm: fx.GraphModule, executors: Sequence[Executor]) -> list[tuple[str, str]]:
    """Moves every assigned op of `gm` into a region submodule (in place).

    Returns (submodule name, executor name) for each region in execution order; the submodules are
    named `region0`, `region1`, ... in that order.
    """
    for k, ex in enumerate(executors):
        partitioner = CapabilityBasedPartitioner(gm, _AssignedTo(ex.name), allows_single_node_partition=True)
        partitions = partitioner.propose_partitions()
        if ex.kind == "operator":
            partitions = [p for part in partitions for p in _single_ops(part)]
        if not partitions:
            continue
        prefix = f"_part{k}_"
        fuse_by_partitions(gm, [p.nodes for p in partitions], prefix=prefix, always_return_tuple=True)
        for node in gm.graph.nodes:
            if node.op == "call_module" and node.target.startswith(prefix):
                node.meta["executor"] = ex.name
    return _rename_in_order(gm)


def _single_ops(part: Partition) -> list[Partition]:
    """Splits a partition into one per op, each with the getitems reading its outputs."""
    out = []
    for node in part.nodes:
        if node.target is operator.getitem:
            continue
        single = Partition(nodes=[node] + [u for u in node.users if u.target is operator.getitem])
        out.append(single)
    return out


def _rename_in_order(gm: fx.GraphModule) -> list[tuple[str, str]]:
    regions = []
    renames = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            new = f"region{len(regions)}"
            renames[new] = gm.get_submodule(node.target)
            node.target = new
            regions.append((new, node.meta["executor"]))
    for name, _ in list(gm.named_children()):
        delattr(gm, name)
    for name, sub in renames.items():
        gm.add_submodule(name, sub)
    gm.recompile()
    return regions
