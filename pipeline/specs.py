"""Input and output specs for the traces of each stage: what every graph input and output is."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.fx as fx

from ir import InputSpec, OutputSpec


def captured_input_specs(gm: fx.GraphModule, example_inputs: Sequence,
                         owners: dict[int, tuple[str, str]]) -> list[InputSpec]:
    """Specs of a Dynamo graph's inputs. `owners` maps id(tensor) -> (kind, qualified name) for the
    module's parameters and buffers, which Dynamo passes as graph inputs."""
    specs = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, (int, torch.SymInt)):
            specs.append(InputSpec("symint", node.name))
        elif id(value) in owners:
            kind, qualname = owners[id(value)]
            specs.append(InputSpec(kind, node.name, qualname))
        else:
            specs.append(InputSpec(_kind_from_source(node), node.name, _source_name(node)))
    return specs


def lowered_input_specs(gm: fx.GraphModule, captured: Sequence[InputSpec], stage: str) -> list[InputSpec]:
    """Specs of an AOTAutograd graph's inputs: the captured inputs (forward/inference), or saved
    values and tangents (backward)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if stage == "backward":
        return [_backward_input_spec(n, captured) for n in placeholders]
    out = []
    for i, n in enumerate(placeholders):
        if n.name.startswith("tangents"):
            out.append(InputSpec("tangent", n.name))
            continue
        c = captured[i] if i < len(captured) else InputSpec("user_input", n.name)
        out.append(InputSpec(c.kind, n.name, c.qualname))
    return out


def _backward_input_spec(node: fx.Node, captured: Sequence[InputSpec]) -> InputSpec:
    """A backward input is a tangent, a forward input saved for backward (AOTAutograd names those
    primals_<k>: it keeps the qualified name), or a saved activation."""
    if node.name.startswith("tangents"):
        return InputSpec("tangent", node.name)
    if node.name.startswith("primals_") and node.name[8:].isdigit():
        k = int(node.name[8:]) - 1
        if k < len(captured):
            return InputSpec("saved", node.name, captured[k].qualname or captured[k].name)
    return InputSpec("saved", node.name)


def lowered_output_specs(gm: fx.GraphModule, captured: Sequence[InputSpec], stage: str,
                         fw_metadata=None, num_forward_outputs: int = 0) -> list[OutputSpec]:
    """Specs of an AOTAutograd graph's outputs, read from AOTAutograd's view/mutation metadata."""
    out = list(gm.graph.output_node().args[0]) if hasattr(gm.graph, "output_node") else \
        list(next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0])
    if stage == "backward":
        return [OutputSpec("grad", _label(captured[i]) if i < len(captured) else None)
                for i in range(len(out))]
    if stage == "joint":
        return [OutputSpec("forward_output" if i < num_forward_outputs else "grad")
                for i in range(len(out))]
    specs: list[OutputSpec] = []
    if fw_metadata is not None:
        for i in fw_metadata.mutated_inp_runtime_indices:
            specs.append(OutputSpec("mutated_input", _label(captured[i]) if i < len(captured) else None))
        specs += [OutputSpec("user_output")] * fw_metadata.num_outputs
        specs += [OutputSpec("intermediate_base")] * fw_metadata.num_intermediate_bases
    rest = "saved" if stage == "forward" else "user_output"
    specs += [OutputSpec(rest)] * (len(out) - len(specs))
    return specs[:len(out)]


def _label(spec: InputSpec) -> str:
    return spec.qualname or spec.name


def _kind_from_source(node: fx.Node) -> str:
    name = _source_name(node) or ""
    if "._parameters[" in name:
        return "parameter"
    if "._buffers[" in name:
        return "buffer"
    return "user_input"


def _source_name(node: fx.Node) -> Optional[str]:
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)  # a method on older torch, a property on newer
    return name() if callable(name) else name
