"""`cpu_offload()`: saved activations wait for the backward in CPU memory (docs/passes.md). Forward and backward traces
list the saved values in one order, so one rule picks the same ones on both sides; both copies are `aten._to_copy`."""

import torch
import torch.fx as fx

from ir import InputKind, OutputKind, Stage, Trace, fake_like, node_value

from .base import TracePass, pass_factory

aten = torch.ops.aten


@pass_factory
def cpu_offload(min_bytes: int = 1 << 16) -> TracePass:
    """An after-autodiff pass offloading saved activations of at least `min_bytes` to the CPU."""
    if not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"cpu_offload: min_bytes must be a non-negative int, got {min_bytes!r}")

    def offloaded(value) -> bool:
        return isinstance(value, torch.Tensor) and _nbytes(value) >= min_bytes

    def apply(trace: Trace) -> Trace:
        if trace.stage not in (Stage.FORWARD, Stage.BACKWARD):
            return trace
        gm = trace.editable()
        (_offload_saved_outputs if trace.stage == Stage.FORWARD else _reload_saved_inputs)(gm, trace, offloaded)
        gm.recompile()
        return trace.derive(gm, by="cpu_offload")

    return TracePass(apply, runs_on="after_autodiff", name="cpu_offload")


def _offload_saved_outputs(gm: fx.GraphModule, trace: Trace, offloaded) -> None:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = list(output.args[0])
    for i, (value, spec) in enumerate(zip(values, trace.outputs)):
        if (spec.kind != OutputKind.SAVED or not isinstance(value, fx.Node) or value.op == "placeholder"
                or not offloaded(fake := node_value(value))):
            continue
        on_cuda = fake.device.type == "cuda"
        with gm.graph.inserting_before(output):
            copy = gm.graph.call_function(aten._to_copy.default, (value,), {
                "device": torch.device("cpu"), "pin_memory": on_cuda, "non_blocking": on_cuda})
        copy.meta["val"] = _on_cpu(fake)
        values[i] = copy
    output.args = (tuple(values),)


def _reload_saved_inputs(gm: fx.GraphModule, trace: Trace, offloaded) -> None:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node, spec in zip(list(gm.graph.nodes), trace.inputs):
        if (node.op != "placeholder" or spec.kind != InputKind.SAVED or spec.qualname is not None
                or not offloaded(fake := node_value(node)) or not node.users):
            continue
        with gm.graph.inserting_before(min(node.users, key=order.__getitem__)):
            reload = gm.graph.call_function(aten._to_copy.default, (node,), {
                "device": fake.device, "non_blocking": fake.device.type == "cuda"})
        reload.meta["val"] = fake
        node.replace_all_uses_with(reload, delete_user_cb=lambda user: user is not reload)
        node.meta["val"] = _on_cpu(fake)


def _on_cpu(fake: torch.Tensor) -> torch.Tensor:
    return fake_like(fake, fake.shape, stride=fake.stride(), device=torch.device("cpu"))


def _nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.numel()) * t.element_size()
    except Exception:  # symbolic sizes: offload
        return 1 << 62
