"""`mixed_precision(dtype)`: bf16/fp16 compute, fp32 master parameters, as `torch.autocast` would (docs/passes.md): the
program runs under autocast, so the lowered trace shows each cast, the backward's path to the fp32 parameters."""

import torch

from ir import Trace, node_value
from ir.rewrite import add_call

from .base import TracePass, pass_factory

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


@pass_factory
def mixed_precision(dtype: str = "bf16") -> TracePass:
    """A before-autodiff pass computing in `dtype` ("bf16" or "fp16") where autocast would."""
    if dtype not in DTYPES:
        raise ValueError(f"mixed_precision: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    low, name = DTYPES[dtype], f"mixed_precision({dtype})"

    def apply(trace: Trace) -> Trace:
        gm = trace.editable()
        graph = gm.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        device = next((v.device.type for v in map(node_value, placeholders)
                       if isinstance(v, torch.Tensor) and v.is_floating_point()), "cpu")
        with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):
            enter = add_call(graph, torch.amp.autocast_mode._enter_autocast, (device, low, True, None), None)
        with graph.inserting_before(graph.output_node()):
            add_call(graph, torch.amp.autocast_mode._exit_autocast, (enter,), None)
        gm.recompile()
        _propagate_metadata(gm, placeholders)
        return trace.derive(gm, by=name)

    return TracePass(apply, runs_on="before_autodiff", name=name, output_dtypes_may_change=True)


def _propagate_metadata(gm, placeholders) -> None:
    """Recomputes every fake value under the autocast region, so the printed trace shows the real dtypes."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    values = [node_value(n) for n in placeholders]
    modes = {id(v.fake_mode): v.fake_mode for v in values if hasattr(v, "fake_mode")}
    if len(modes) != 1 or any(v is None for v in values):
        return  # keep the captured metadata rather than mix fake modes
    FakeTensorProp(gm, mode=next(iter(modes.values()))).propagate_dont_convert_inputs(*values)
    for node in gm.graph.nodes:
        if "example_value" in node.meta and "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]
