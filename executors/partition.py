"""Groups assigned ops into cycle-free regions, one fx submodule per region.

Built on torch.fx's `CapabilityBasedPartitioner`, run once per executor: a fusion executor's ops
are merged into as few regions as cycle-freedom allows; an operator executor gets one region per op.
Two cases skip the partitioner, whose merging is quadratic in the graph size (seconds on a 16-layer
model): an operator executor's single ops (one op cannot form a cycle), and a fusion executor that
claims every op left (one region holding all computation cannot either).
"""
from __future__ import annotations

import operator
from typing import Sequence

import torch.fx as fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
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
        assigned = [n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get("executor") == ex.name]
        if not assigned:
            continue
        if ex.kind == "operator":
            partitions = [[n] + [u for u in n.users if u.target is operator.getitem]
                          for n in assigned if n.target is not operator.getitem]
        elif _computes_everything(gm, len(assigned)):
            partitions = [assigned]
        else:
            partitioner = CapabilityBasedPartitioner(gm, _AssignedTo(ex.name), allows_single_node_partition=True)
            partitions = [list(p.nodes) for p in partitioner.propose_partitions()]
        if not partitions:
            continue
        prefix = f"_part{k}_"
        fuse_by_partitions(gm, [dict.fromkeys(p) for p in partitions], prefix=prefix, always_return_tuple=True)
        for node in gm.graph.nodes:
            if node.op == "call_module" and node.target.startswith(prefix):
                node.meta["executor"] = ex.name
    return _rename_in_order(gm)


def _computes_everything(gm: fx.GraphModule, n_assigned: int) -> bool:
    """Whether the `n_assigned` ops are all the computation left in `gm` (no other op, no region)."""
    return sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_module", "call_method")) == n_assigned


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
