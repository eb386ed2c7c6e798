"""Capture for models that differentiate inside forward (`torch.autograd.grad(..., create_graph=True)`): traced with
`make_fx` through the inner gradient (docs/design.md, "Stages"). The engine's `aten.detach` of saved activations
would cut the forces' dependence on the parameters: those are removed; detaches the user wrote are marked and kept."""

import dataclasses
import types
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .cache import global_modes
from .compiler import PipelineBackend


def differentiates_inside(model_or_fn) -> bool:
    """Whether the forward code calls `autograd.grad`: a scan of the code objects (each module's forward,
    or the function) for the attribute `grad` next to `autograd`, following the module-level functions
    and the methods of the module's class they name, a few calls deep (a helper computing forces)."""
    modules = model_or_fn.modules() if isinstance(model_or_fn, torch.nn.Module) else ()
    starts = [(type(m).forward, type(m)) for m in modules if isinstance(getattr(type(m), "forward", None), types.FunctionType)]
    seen: set = set()
    return any(_calls_autograd_grad(fn, cls, seen) for fn, cls in starts or [(model_or_fn, None)])


def _calls_autograd_grad(fn, cls, seen: set, depth: int = 0) -> bool:
    code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    if code is None or code in seen or depth > 3 or (depth and (fn.__module__ or "").split(".")[0] == "torch"):
        return False
    seen.add(code)
    names = _names(code)
    called = [scope[n] if isinstance(scope.get(n), types.FunctionType) else getattr(cls, n, None) for n in names]
    return {"autograd", "grad"} <= names or any(
        _calls_autograd_grad(f, cls, seen, depth + 1) for f in called if isinstance(f, types.FunctionType))


def _names(code: types.CodeType) -> set:
    return set(code.co_names).union(*(_names(c) for c in code.co_consts if isinstance(c, types.CodeType)))


@torch.library.custom_op("pipeline::user_detach", mutates_args=())
def _user_detach(x: torch.Tensor) -> torch.Tensor:
    """Marks a detach the user wrote, while tracing; replaced by `aten.detach` right after."""
    return x.detach().clone()


@_user_detach.register_fake
def _(x):
    return torch.empty_like(x)


class _MarkUserDetach(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.detach, torch.detach):
            # the inner detach is the engine-like one (removed); the marker becomes the real detach
            return _user_detach(args[0].detach())
        return func(*args, **(kwargs or {}))


def trace_through_grad(fn: Callable, example_inputs: list) -> fx.GraphModule:
    """`make_fx` of `fn` on fake copies of `example_inputs`, the engine's detaches removed."""
    with torch.enable_grad(), _MarkUserDetach():
        gm = make_fx(fn, tracing_mode="fake")(*example_inputs)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.op == "call_function" and node.target is torch.ops.pipeline.user_detach.default:
            node.target = torch.ops.aten.detach.default
    graph.eliminate_dead_code()
    gm.recompile()
    return gm


@dataclasses.dataclass
class _Entry:
    compiled: Callable
    out_spec: Any


def _module_state(m: torch.nn.Module) -> tuple:
    """What a capture bakes in of a submodule: train/eval and its hooks, by handle (one added later must recompile);
    the hook-less common case costs one `any` (this runs for every submodule at every call)."""
    hooks = m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks
    return (m.training, *map(tuple, hooks)) if any(hooks) else m.training


class GradCapture:
    """Compiles and runs a model through `trace_through_grad`, one compilation per input signature (shapes, dtypes,
    requires_grad, the global modes `cache.global_modes` names, each submodule's train/eval and hooks)."""

    def __init__(self, model_or_fn, state):
        self.target, self.state = model_or_fn, state
        self.cache: dict[tuple, _Entry] = {}

    def __call__(self, *args, **kwargs):
        module = self.target if isinstance(self.target, torch.nn.Module) else None
        params = dict(module.named_parameters()) if module is not None else {}
        buffers = dict(module.named_buffers()) if module is not None else {}
        flat_args, in_spec = pytree.tree_flatten((args, kwargs))
        key = (in_spec, global_modes(), tuple(map(_module_state, module.modules())) if module is not None else None,
               tuple(_signature(v) for v in [*params.values(), *buffers.values(), *flat_args]))
        if (entry := self.cache.get(key)) is None:
            if self.cache:
                self.state.history.recompiles += 1
            entry = self.cache[key] = self._compile(params, buffers, flat_args, in_spec)
        tensors = [*params.values(), *buffers.values(), *(a for a in flat_args if isinstance(a, torch.Tensor))]
        return pytree.tree_unflatten(list(entry.compiled(*tensors)), entry.out_spec)

    def _compile(self, params, buffers, flat_args, in_spec) -> _Entry:
        names = [*params, *buffers]
        tensor_positions = [i for i, a in enumerate(flat_args) if isinstance(a, torch.Tensor)]
        out_spec = []

        def flat_forward(*tensors):
            state = dict(zip(names, tensors[:len(names)]))
            filled = list(flat_args)
            for i, t in zip(tensor_positions, tensors[len(names):]):
                filled[i] = t
            args, kwargs = pytree.tree_unflatten(filled, in_spec)
            out = (torch.func.functional_call(self.target, state, args, kwargs)
                   if isinstance(self.target, torch.nn.Module) else self.target(*args, **kwargs))
            flat_out, spec = pytree.tree_flatten(out)
            out_spec.append(spec)
            return flat_out

        inputs = [*params.values(), *buffers.values(), *(flat_args[i] for i in tensor_positions)]
        gm = trace_through_grad(flat_forward, inputs)
        backend = PipelineBackend(self.state, level="aten", capture="capture (make_fx through autograd.grad)")
        return _Entry(backend(gm, inputs), out_spec[-1])


def _signature(v):
    return (tuple(v.shape), v.dtype, v.device, v.requires_grad) if isinstance(v, torch.Tensor) else (type(v), v)
