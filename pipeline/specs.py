"""Input and output specs for the traces of each stage: what every graph input and output is."""

from typing import Optional, Sequence

import torch
import torch.fx as fx

from torch._functorch._aot_autograd.descriptors import (
    BackwardTokenAOTInput, PhiloxBackwardBaseOffsetAOTInput, PhiloxBackwardSeedAOTInput,
    PhiloxForwardBaseOffsetAOTInput, PhiloxForwardSeedAOTInput, PlainAOTInput)

from ir import InputKind, InputSpec, OutputKind, OutputSpec, Stage, node_value


def captured_input_specs(gm: fx.GraphModule, example_inputs: Sequence,
                         owners: dict[int, tuple[str, str]]) -> list[InputSpec]:
    """Specs of a Dynamo graph's inputs; `owners`: id(tensor) -> (kind, qualname) of the module's parameters/buffers."""
    specs = []
    for node, value in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs):
        if isinstance(value, (int, torch.SymInt)):
            specs.append(InputSpec(InputKind.SYMINT, node.name))
        elif (owner := owners.get(id(value))) is not None:  # (kind, qualified name)
            specs.append(InputSpec(owner[0], node.name, owner[1]))
        else:
            specs.append(InputSpec(_kind_from_source(node), node.name, _source_name(node)))
    return specs


def lowered_input_specs(gm: fx.GraphModule, captured: Sequence[InputSpec], stage: Stage) -> list[InputSpec]:
    """Specs of an AOTAutograd graph's inputs, from the descriptor on each placeholder (`meta["desc"]`):
    the captured input it is, a tangent, an RNG seed; in a backward, a value saved for it, or a tangent."""
    return [_lowered_input_spec(n, i, captured, stage) for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))]


def _lowered_input_spec(node: fx.Node, position: int, captured: Sequence[InputSpec], stage: Stage) -> InputSpec:
    if isinstance(desc := node.meta.get("desc"), BackwardTokenAOTInput) or (desc is not None and desc.is_tangent()):
        return InputSpec(InputKind.TANGENT, node.name)
    if isinstance(desc, _SEEDS) or isinstance(node_value(node), torch.Generator):  # graph-safe RNG state
        return InputSpec(InputKind.SEED, node.name)
    origin = _captured_input(desc, captured)
    if stage == Stage.BACKWARD:  # a forward input saved for backward keeps its qualified name
        return InputSpec(InputKind.SAVED, node.name, origin and _label(origin))
    if desc is None:  # not from AOTAutograd's tracing: the captured inputs, in order
        origin = captured[position] if position < len(captured) else None
    if origin is None:
        return InputSpec(InputKind.USER_INPUT, node.name)
    return InputSpec(origin.kind, node.name, origin.qualname)


_SEEDS = (PhiloxForwardSeedAOTInput, PhiloxForwardBaseOffsetAOTInput, PhiloxBackwardSeedAOTInput,
          PhiloxBackwardBaseOffsetAOTInput)


def _captured_input(desc, captured: Sequence[InputSpec]) -> Optional[InputSpec]:
    """The captured input an AOTAutograd input descriptor stands for (through a tensor subclass's
    attribute or a synthetic base), or None (an activation, a token, a lifted parameter)."""
    while desc is not None and not isinstance(desc, PlainAOTInput):
        desc = getattr(desc, "base", None) or getattr(desc, "base_of", None)
    return None if desc is None or desc.idx >= len(captured) else captured[desc.idx]


def lowered_output_specs(gm: fx.GraphModule, captured: Sequence[InputSpec], stage: Stage,
                         fw_metadata=None, num_forward_outputs: int = 0) -> list[OutputSpec]:
    """Specs of an AOTAutograd graph's outputs, read from AOTAutograd's view/mutation metadata."""
    out = list(gm.graph.output_node().args[0])
    if stage == Stage.BACKWARD:
        return [OutputSpec(OutputKind.GRAD, _label(captured[i]) if i < len(captured) else None)
                for i in range(len(out))]
    if stage == Stage.JOINT:  # a forward output written back to an input targets its placeholder (AOTAutograd's desc)
        descs, inputs = gm.graph.output_node().meta.get("desc") or (), gm.graph.find_nodes(op="placeholder")
        written = [next((n.name for n in inputs if (d := getattr(desc, "mutated_input", None)) is not None
                         and n.meta.get("desc") == d), None) for desc in descs]
        return [OutputSpec(OutputKind.FORWARD_OUTPUT, written[i] if i < len(written) else None)
                if i < num_forward_outputs else OutputSpec(OutputKind.GRAD) for i in range(len(out))]
    specs: list[OutputSpec] = []
    if fw_metadata is not None:
        specs += [OutputSpec(OutputKind.MUTATED_INPUT, _label(captured[i]) if i < len(captured) else None)
                  for i in fw_metadata.mutated_inp_runtime_indices]
        specs += [OutputSpec(OutputKind.USER_OUTPUT)] * fw_metadata.num_outputs
        specs += [OutputSpec(OutputKind.INTERMEDIATE_BASE)] * fw_metadata.num_intermediate_bases
    rest = OutputKind.SAVED if stage == Stage.FORWARD else OutputKind.USER_OUTPUT
    specs += [OutputSpec(rest)] * (len(out) - len(specs))
    return specs[:len(out)]


def _label(spec: InputSpec) -> str:
    return spec.qualname or spec.name


def _kind_from_source(node: fx.Node) -> InputKind:
    if "._parameters[" in (name := _source_name(node) or ""):
        return InputKind.PARAMETER
    return InputKind.BUFFER if "._buffers[" in name else InputKind.USER_INPUT


def _source_name(node: fx.Node) -> Optional[str]:
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)  # a method on older torch, a property on newer
    return name() if callable(name) else name
