"""What the picture shows, read from what the pipeline recorded for a jitted model: one box per kind
of region, one wire per pair of boxes that pass tensors.

Identical regions (the same layer one level down) run the code compiled for the first of them
(`Region.compiled_as`): they fold into that one's box, with a count, so a 16-layer model draws its
layer once. Wires come from the execution traces (one `call_module` per region, its outputs taken
by `getitem`) and, from the forward to the backward, from the activations the forward saves: the
forward's `saved` outputs are the backward's `saved` inputs, in order (AOTAutograd's contract). What
one box saves is one wire, to the first backward box that reads it (all of them in `readers`): a wire
per reader would cross the picture dozens of times in a transformer layer."""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Iterable, Optional

import torch
import torch.fx as fx

from ir import Region, Trace, describe_value, node_value
from pipeline.inspect import _state


@dataclasses.dataclass
class Box:
    region: Region                 # the first of its kind: the one that was compiled
    members: list[int]             # ids of the regions it stands for, itself first
    ms: Optional[float] = None     # profiled time of all of them together, when a profile is given

    @property
    def count(self) -> int:
        return len(self.members)


@dataclasses.dataclass
class Wire:
    src: int                       # box ids: the id of the first region of each kind
    dst: int
    saved: bool                    # kept by the forward for the backward
    tensors: list[tuple[str, Optional[int]]] = dataclasses.field(default_factory=list)  # ("f32[8, 16]", bytes)
    readers: list[int] = dataclasses.field(default_factory=list)  # saved: every backward box reading them

    @property
    def nbytes(self) -> int:
        return sum(b or 0 for _, b in self.tensors)


@dataclasses.dataclass
class RegionGraph:
    boxes: dict[int, Box]          # by box id, in region order
    wires: list[Wire]


def region_graph(cm, profile: Optional[Iterable] = None) -> RegionGraph:
    """The boxes and wires of `cm` (a `pipeline.jit` result that has run); `profile`: what
    `pipeline.profile(cm, ...)` returned (anything with `.id` and `.ms` per region)."""
    history = _state(cm).history
    if not history.calls:
        raise RuntimeError("pipeline.draw: nothing compiled yet: call the jitted model once (cm(*inputs)), "
                           "then draw it")
    regions = [r for rec in history.records for r in rec.regions]
    if not regions:
        raise RuntimeError("pipeline.draw: nothing to draw: no region was compiled, the model ran in eager "
                           "(pipeline.compile_stats(cm) says why)")
    ids = {r.id for r in regions}
    fold = {r.id: r.compiled_as if r.compiled_as in ids else r.id for r in regions}
    boxes = {r.id: Box(r, [r.id]) for r in regions if fold[r.id] == r.id}
    for r in regions:
        if fold[r.id] != r.id:
            boxes[fold[r.id]].members.append(r.id)
    for t in profile or ():
        box = boxes.get(fold.get(t.id))
        if box is not None:
            box.ms = (box.ms or 0.0) + t.ms
    wires: dict[tuple, Wire] = {}
    for record in history.records:
        stages = _execution_traces(record.traces)
        for trace in stages.values():
            _add_stage_wires(trace, fold, wires)
        if "forward" in stages and "backward" in stages:
            _add_saved_wires(stages["forward"], stages["backward"], fold, wires)
    return RegionGraph(boxes, list(wires.values()))


def _execution_traces(traces: list[Trace]) -> dict[str, Trace]:
    """The last trace of each stage whose ops are compiled regions."""
    out = {}
    for trace in traces:
        if any(_region_of(trace, n) for n in trace.graph.nodes):
            out[str(trace.stage)] = trace
    return out


def _region_of(trace: Trace, node: fx.Node) -> Optional[Region]:
    if node.op != "call_module":
        return None
    region = getattr(trace.module.get_submodule(node.target), "region", None)
    return region if isinstance(region, Region) else None


def _producer(trace: Trace, value: fx.Node) -> Optional[Region]:
    """The region whose output `value` is (`getitem` of its call), or None (a stage input, say)."""
    if value.op == "call_function" and value.target is operator.getitem and isinstance(value.args[0], fx.Node):
        return _region_of(trace, value.args[0])
    return None


def _add(wire: Wire, value: fx.Node) -> None:
    v = node_value(value)
    wire.tensors.append((describe_value(v), _nbytes(v)))


def _add_stage_wires(trace: Trace, fold: dict, wires: dict) -> None:
    for node in trace.graph.nodes:
        dst = _region_of(trace, node)
        if dst is None:
            continue
        for arg in dict.fromkeys(a for a in node.args if isinstance(a, fx.Node)):
            src = _producer(trace, arg)
            if src is not None and src.id in fold and dst.id in fold:
                key = (fold[src.id], fold[dst.id])
                _add(wires.setdefault(key, Wire(*key, saved=False)), arg)


def _add_saved_wires(forward: Trace, backward: Trace, fold: dict, wires: dict) -> None:
    outs = [a for a, spec in zip(forward.output_node().args[0], forward.outputs) if spec.kind == "saved"]
    ins = [p for p, spec in zip(backward.placeholders(), backward.inputs) if spec.kind == "saved"]
    if len(outs) != len(ins):  # not the pairing AOTAutograd makes: draw no saved wires rather than wrong ones
        return
    for value, placeholder in zip(outs, ins):
        src = _producer(forward, value) if isinstance(value, fx.Node) else None
        readers = sorted({fold[r.id] for r in map(functools.partial(_region_of, backward), placeholder.users)
                          if r is not None and r.id in fold})
        if src is None or src.id not in fold or not readers:  # e.g. a weight, kept as it came in
            continue
        key = ("saved", fold[src.id], backward.name)
        wire = wires.setdefault(key, Wire(fold[src.id], readers[0], saved=True))
        wire.readers = sorted(set(wire.readers) | set(readers))
        wire.dst = wire.readers[0]
        _add(wire, value)


def _nbytes(v) -> Optional[int]:
    """A tensor's size in bytes (its size hint when symbolic), None when unknown."""
    if not isinstance(v, torch.Tensor):
        return None
    n = v.numel()
    if isinstance(n, torch.SymInt):
        n = n.node.hint
    return None if n is None else int(n) * v.element_size()
