"""Capture for models that differentiate inside forward (`torch.autograd.grad(..., create_graph=True)`): traced with
`make_fx` through the inner gradient (docs/design.md, "Stages"). The engine's `aten.detach` of saved activations
would cut the forces' dependence on the parameters: those are removed; detaches the user wrote are marked and kept."""

import dataclasses
import inspect
import types
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .cache import PLAIN, _cell_filled, global_modes
from .compiler import PipelineBackend
from .fallbacks import report_fallback


def differentiates_inside(model_or_fn) -> bool:
    """Whether the forward code calls `autograd.grad` (the attribute `grad` next to `autograd`)."""
    return any({"autograd", "grad"} <= _names(f.__code__) for f in _forward_code(model_or_fn))


def _forward_code(model_or_fn) -> list[types.FunctionType]:
    """The forward code: each module's forward (or the function), and the module-level functions and methods of the
    module's class it names, a few calls deep (a helper computing forces), torch's own excepted."""
    modules = model_or_fn.modules() if isinstance(model_or_fn, torch.nn.Module) else ()
    starts = [(type(m).forward, type(m)) for m in modules if isinstance(getattr(type(m), "forward", None), types.FunctionType)]
    found, todo = {}, [(fn, cls, 0) for fn, cls in starts or [(model_or_fn, None)]]
    while todo:
        fn, cls, depth = todo.pop()
        code = getattr(fn, "__code__", None)
        if code is None or code in found or depth > 3 or (depth and (fn.__module__ or "").split(".")[0] == "torch"):
            continue
        found[code] = fn
        named = (fn.__globals__[n] if isinstance(fn.__globals__.get(n), types.FunctionType) else getattr(cls, n, None)
                 for n in _names(code))
        todo += [(f, cls, depth + 1) for f in named if isinstance(f, types.FunctionType)]
    return list(found.values())


def _names(code: types.CodeType) -> set:
    return set(code.co_names).union(*(_names(c) for c in code.co_consts if isinstance(c, types.CodeType)))


@torch.library.custom_op("pipeline::user_detach", mutates_args=())
def _user_detach(x: torch.Tensor) -> torch.Tensor:
    """Marks a detach the user wrote, while tracing; replaced by `aten.detach` right after."""
    return x.detach().clone()


@_user_detach.register_fake
def _(x):
    return torch.empty_like(x)


class NotCapturable(Exception):
    """The forward does what a `make_fx` capture through `autograd.grad` cannot keep; the message says what."""


class _MarkUserDetach(TorchFunctionMode):
    """Marks what the user cut from the gradient (`detach`, `.data`, ops under `torch.no_grad()`): `make_fx` records
    ops, not grad mode. Ops run without grad on other grounds (an `autograd.Function`'s forward) are refused."""
    user_grad_off = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch._C._set_grad_enabled:
            self.user_grad_off = not args[0]
        if func in (torch.Tensor.detach, torch.detach) or getattr(func, "__self__", None) is torch.Tensor.data:
            # the inner detach is the engine-like one (removed); the marker becomes the real detach
            return _user_detach(args[0].detach())
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled() or not any(getattr(a, "requires_grad", False) for a in pytree.tree_leaves(args)):
            return out
        if not self.user_grad_off:
            raise NotCapturable(f"{getattr(func, '__qualname__', func)} runs without grad outside torch.no_grad() "
                                f"(an autograd.Function's forward? its backward would be lost)")
        return pytree.tree_map_only(torch.Tensor, _user_detach, out)


def trace_through_grad(fn: Callable, example_inputs: list) -> fx.GraphModule:
    """`make_fx` of `fn` on fake copies of `example_inputs`, the engine's detaches removed."""
    try:
        with torch.enable_grad(), _MarkUserDetach():
            gm = make_fx(fn, tracing_mode="fake")(*example_inputs)
    except AssertionError as e:  # make_fx met a tensor it was not given
        if "convert all Tensors to FakeTensors" not in str(e):
            raise
        raise NotCapturable(f"{str(e).split('Found in ')[-1].split('(')[0]} reads a tensor that is neither a parameter, "
                            "a buffer nor an input (an attribute, a global, a closure): make it a buffer or an argument")
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


_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training"}


@dataclasses.dataclass
class _Entry:
    compiled: Optional[Callable]  # None: runs in eager (`NotCapturable`)
    out_spec: Any
    rebound: list[str]  # the buffers the forward rebinds (`self.steps = self.steps + 1`), its last outputs
    grad_on: list[int]  # the inputs the forward turns `requires_grad` on for (forces: `x.requires_grad_()`)


def _snapshot(v, depth: int = 0):
    """What a capture bakes in of a value it reads: plain values, and containers and objects' fields of them (a config
    dataclass, a list of coefficients), however deep; tensors, functions, modules and slotted objects by identity."""
    if isinstance(v, PLAIN):
        return v
    if depth > 8:
        raise NotCapturable("a value the forward may read is nested over 8 levels deep (a cycle?): not keyable")
    if isinstance(v, (set, frozenset)):
        return type(v), frozenset(_snapshot(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return type(v), *((_snapshot(k, depth + 1), _snapshot(x, depth + 1)) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return type(v), *(_snapshot(x, depth + 1) for x in v)
    if callable(v) or inspect.ismodule(v) or isinstance(v, torch.Tensor) or not hasattr(v, "__dict__"):
        return type(v), id(v)
    return type(v), _snapshot(vars(v), depth + 1)


def _class_fields(cls: type) -> tuple:
    """A module class's plain attributes (`cutoff = 5.0` in its body) along its bases, up to `nn.Module`."""
    mro = cls.__mro__[:cls.__mro__.index(torch.nn.Module)]
    return tuple((c.__qualname__, k, _snapshot(v)) for c in mro for k, v in vars(c).items() if not k.startswith("__")
                 and not isinstance(v, (types.FunctionType, property, staticmethod, classmethod)))


def _module_state(m: torch.nn.Module) -> tuple:
    """What a capture bakes in of a submodule: its fields (train/eval, a scale, a config choosing a branch) and its
    hooks, by handle (one added later must recompile)."""
    hooks = m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks
    fields = tuple((k, _snapshot(v)) for k, v in vars(m).items() if k not in _MODULE_INTERNALS)
    return (fields, *map(tuple, hooks)) if any(hooks) else fields


class GradCapture:
    """Compiles and runs a model through `trace_through_grad`, one compilation per input signature (shapes, dtypes,
    requires_grad, the global modes `cache.global_modes` names, each submodule's fields and hooks, the module-level
    values and closure cells the forward code reads)."""

    def __init__(self, model_or_fn, state):
        self.target, self.state = model_or_fn, state
        self.cache, self.uncapturable = {}, False  # key -> _Entry; True: a value the key cannot hold (runs in eager)
        code = _forward_code(model_or_fn)
        self.globals_read = [(f.__globals__, n) for f in code for n in sorted(_names(f.__code__)) if n in f.__globals__]
        self.cells = [c for f in code for c in f.__closure__ or ()]

    def __call__(self, *args, **kwargs):
        if self.uncapturable:  # decided once, not warned at every call
            return self.target(*args, **kwargs)
        module = self.target if isinstance(self.target, torch.nn.Module) else None
        got = (module.named_parameters(), module.named_buffers(), module.modules()) if module is not None else [()] * 3
        params, buffers, modules = dict(got[0]), dict(got[1]), list(got[2])
        flat_args, in_spec = pytree.tree_flatten((args, kwargs))
        try:
            key = (in_spec, global_modes(), tuple(map(_module_state, modules)),
                   tuple(_class_fields(cls) for cls in dict.fromkeys(map(type, modules))),
                   tuple(_signature(v) for v in [*params.values(), *buffers.values(), *flat_args]),
                   tuple(_snapshot(scope.get(n)) for scope, n in self.globals_read),
                   tuple(_snapshot(c.cell_contents) if _cell_filled(c) else None for c in self.cells))
        except NotCapturable as e:
            self.uncapturable = True
            report_fallback(self.state, f"the model runs in eager: {e}")
            return self.target(*args, **kwargs)
        if (entry := self.cache.get(key)) is None:
            if self.cache:
                self.state.history.recompiles += 1
            entry = self.cache[key] = self._compile(params, buffers, flat_args, in_spec)
        if entry.compiled is None:
            return self.target(*args, **kwargs)
        for i in entry.grad_on:
            flat_args[i].requires_grad_(True)
        tensors = [*params.values(), *buffers.values(), *(a for a in flat_args if isinstance(a, torch.Tensor))]
        out = list(entry.compiled(*tensors))
        kept = len(out) - len(entry.rebound)
        for name, value in zip(entry.rebound, out[kept:]):
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, value)
        return pytree.tree_unflatten(out[:kept], entry.out_spec)

    def _compile(self, params, buffers, flat_args, in_spec) -> _Entry:
        names = [*params, *buffers]
        tensor_positions = [i for i, a in enumerate(flat_args) if isinstance(a, torch.Tensor)]
        out_spec, rebound, grad_on = [], {}, []

        def flat_forward(*tensors):
            state = dict(zip(names, tensors[:len(names)]))
            filled = list(flat_args)
            for i, t in zip(tensor_positions, tensors[len(names):]):
                filled[i] = t
            args, kwargs = pytree.tree_unflatten(filled, in_spec)
            if not isinstance(self.target, torch.nn.Module):
                out = self.target(*args, **kwargs)
            else:
                with _reparametrize_module(self.target, state):
                    out = self.target(*args, **kwargs)
                    rebound.update((n, b) for n, b in self.target.named_buffers() if b is not state.get(n))
            flat_out, spec = pytree.tree_flatten(out)
            out_spec.append(spec)
            grad_on[:] = [i for i, t in zip(tensor_positions, tensors[len(names):])
                          if t.requires_grad and not flat_args[i].requires_grad]
            return [*flat_out, *rebound.values()]

        inputs = [*params.values(), *buffers.values(), *(flat_args[i] for i in tensor_positions)]
        try:
            gm = trace_through_grad(flat_forward, inputs)
        except NotCapturable as e:
            report_fallback(self.state, f"the model runs in eager: {e}")
            return _Entry(None, None, [], [])
        for i in grad_on:  # as the forward did in eager, before compiling: its gradient is then computed
            flat_args[i].requires_grad_(True)
        backend = PipelineBackend(self.state, level="aten", capture="capture (make_fx through autograd.grad)")
        return _Entry(backend(gm, inputs), out_spec[-1], list(rebound), grad_on)


def _signature(v):
    return (v.shape, v.stride(), v.dtype, v.device, v.requires_grad) if isinstance(v, torch.Tensor) else (type(v), v)
