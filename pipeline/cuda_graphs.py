"""CUDA graphs for compiled stages (`pipeline.jit(..., cuda_graphs=True)`; docs/executors.md, "CUDA graphs"), through
torch.compile's "reduce-overhead" machinery (`torch._inductor.cudagraph_trees`) and its rules. A stage that cannot be
recorded (`why_not_recordable`) runs region by region, the reason in `pipeline.compile_stats(model).cuda_graphs`."""

from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from ir import InputKind, Stage, Trace


def stage_callable(fn: Callable, trace: Trace, example_inputs: Sequence, why_not: Optional[str], *, stage: str,
                   record) -> Callable:
    """`fn` (a boxed stage running `trace`) recorded as a CUDA graph unless `why_not` (`why_not_recordable`), the
    decision in `record.cuda_graphs[stage]`. A backward is not recorded when its forward is not (its saved activations
    would not stay put); one not recorded tells the graph tree that it ran, or the tree would wait for it forever."""
    forward = record.cuda_graphs.get("forward")
    if stage == "backward" and why_not is None and forward is not None and forward != "on":
        why_not = "its forward is not recorded"
    record.cuda_graphs[stage] = "on" if why_not is None else f"off: {why_not}"
    if why_not is None:
        return record_stage(fn, trace, example_inputs, stage=stage)
    if stage == "backward" and forward == "on":
        return _telling_the_tree(fn, _device_of(trace).index or 0)
    return fn


def why_not_recordable(trace: Trace, example_inputs: Sequence, executors) -> Optional[str]:
    """None when the stage can be recorded as a CUDA graph, else the reason it cannot."""
    from torch._inductor.utils import get_first_incompatible_cudagraph_node
    if not _cuda_available():
        return "no CUDA device here"
    devices: dict[torch.device, str] = {}
    for node in trace.module.graph.nodes:  # every value, not only the inputs (a CPU-offloaded save)
        if isinstance(value := node.meta.get("val"), torch.Tensor) and value.device.type != "meta":
            devices.setdefault(value.device, node.name)
    if (cpu := [f"{name} on {d}" for d, name in devices.items() if d.type != "cuda"]) or not devices:
        return f"a value off the GPU ({', '.join(cpu) or 'no tensors'}): CUDA graphs capture GPU work only"
    if len(devices) > 1:
        return f"values on several GPUs {sorted(str(d) for d in devices)}"
    if any(isinstance(v, torch.SymInt) for v in example_inputs) or any(
            isinstance(t, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in t.shape) for t in example_inputs):
        return "dynamic shapes (each size would need its own graph); use dynamic=False"
    if unsafe := sorted(e.name for e in executors if not e.cuda_graphs_safe):
        return f"executor(s) {unsafe} launch kernels that a CUDA graph cannot capture"
    if (bad := get_first_incompatible_cudagraph_node(trace.module)) is not None:
        return f"{bad.name} ({bad.target}) cannot be captured (data-dependent size or marked unsafe)"
    if mutated := _mutated_inputs(trace.module):
        return f"the stage writes into its inputs {mutated[:3]}"
    return None


def record_stage(fn: Callable, trace: Trace, example_inputs: Sequence, *, stage: str) -> Callable:
    """`fn` (a boxed stage running `trace`) recorded and replayed through cudagraph trees."""
    from torch._inductor.cudagraph_trees import cudagraphify_impl
    from torch._inductor.cudagraph_utils import get_placeholder_info
    run = cudagraphify_impl(fn, list(example_inputs), static_inputs(trace), device_index=_device_of(trace).index or 0,
                            is_backward=stage == "backward", is_inference=stage == "inference",
                            stack_traces=[None] * len(trace.output_values()),  # per output, for its error messages
                            placeholders=tuple(get_placeholder_info(trace.module.graph)))
    run._boxed_call = True  # AOTAutograd hands it the argument list, which it empties
    return run


def static_inputs(trace: Trace) -> list[int]:
    """Inputs at the same address on every call: parameters and buffers; in a backward, everything
    but the tangents and RNG seeds (the saved activations come from the recorded forward)."""
    if trace.stage == Stage.BACKWARD:
        return [i for i, s in enumerate(trace.inputs) if s.kind not in (InputKind.TANGENT, InputKind.SEED)]
    return [i for i, s in enumerate(trace.inputs) if s.kind in (InputKind.PARAMETER, InputKind.BUFFER)]


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _telling_the_tree(fn: Callable, device_index: int) -> Callable:
    from torch._inductor.cudagraph_trees import get_manager

    def run(args: list):
        if (manager := get_manager(device_index, create_if_none_exists=False)) is not None:
            manager.set_to_running_backward()
        return fn(args)
    run._boxed_call = True
    return run


def _device_of(trace: Trace) -> torch.device:
    return next((n.meta["val"].device for n in trace.module.graph.nodes
                 if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].device.type == "cuda"),
                torch.device("cuda", 0))


def _mutated_inputs(gm: fx.GraphModule) -> list[str]:
    placeholders = {n for n in gm.graph.nodes if n.op == "placeholder"}
    out = []
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        bound = {**dict(zip((a.name for a in schema.arguments), node.args)), **node.kwargs}
        for arg in schema.arguments:
            value = bound.get(arg.name)
            if getattr(arg.alias_info, "is_write", False) and isinstance(value, fx.Node) and value in placeholders:
                out.append(value.name)
    return out
