"""`pipeline.jit`: compiles a module or function; the result (`JittedModule`, `JittedFunction`) behaves like it."""

import collections
import copy
import dataclasses
import functools
import inspect
import logging
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch._dynamo

from executors import Executor, resolve
from ir import InputKind
from transforms import TracePass, as_pass
from transforms.materialize import Materialize
from transforms.model_transform import ModelTransform

from . import model_state

from .cache import save_changed
from .compiler import PassError, PipelineBackend, old_objects_frozen
from .default_passes import Without, with_defaults
from .fallbacks import MODES, PipelineFallbackError, report_fallback
from .grad_capture import GradCapture, differentiates_inside
from .record import GraphRecord


class GraphBreakError(RuntimeError):
    """`fullgraph=True` and Dynamo had to break the graph; names the reason and the user's line."""


@dataclasses.dataclass(frozen=True)
class JitConfig:
    """What `jit` fixed for a model, the same at every call: `state.config`."""
    executors: tuple[Executor, ...]
    passes: tuple[TracePass, ...]
    owners: dict[int, tuple[str, str]]       # id(tensor) -> (parameter|buffer, qualified name)
    replaced: dict = dataclasses.field(default_factory=dict)  # qualname -> model_state.Replaced
    fullgraph: bool = False
    dynamic: Optional[bool] = None
    cache: bool = True                       # use the compiled-artifact cache (pipeline/cache.py)
    cuda_graphs: bool = False                # record each stage as a CUDA graph (pipeline/cuda_graphs.py)
    fallback: str = "warn"                   # "warn" | "raise": what a fallback to eager does (fallbacks.py)
    autotune: bool = False                   # race the executors that can take a region (executors/autotune.py)
    call_hooks: tuple = ()                   # executors' before_call


@dataclasses.dataclass
class CallHistory:
    """What the calls of a jitted model add to: `state.history`."""
    records: list[GraphRecord] = dataclasses.field(default_factory=list)  # every compiled graph
    graph_breaks: list[str] = dataclasses.field(default_factory=list)
    recompiles: int = 0
    generation: int = 0                      # number of calls that compiled something
    capture_seconds: float = 0.0
    first_shapes: Optional[tuple] = None     # input shapes of the first call (automatic dynamic)
    generalized: bool = False                # whether a shape change already made inputs dynamic
    fallbacks: list[str] = dataclasses.field(default_factory=list)  # every fallback, in order
    calls: int = 0                           # calls of the jitted model that returned
    hook_guards_lent: bool = False           # the backend turned Dynamo's module hook guards on for this call


@dataclasses.dataclass(frozen=True)
class CompileState:
    """Everything the pipeline keeps for one jitted model: what jit fixed, and what the calls added."""
    config: JitConfig
    history: CallHistory = dataclasses.field(default_factory=CallHistory)


def jit(model_or_fn: Callable, *, executors: Sequence = ("inductor",), transforms: Sequence = (),
        fullgraph: bool = False, dynamic: Optional[bool] = None, cache: bool = True,
        cuda_graphs: bool = False, fallback: str = "warn", autotune: bool = False):
    """Compiles `model_or_fn` (an `nn.Module` or a function).

    executors: `executors` objects or their names, by priority; ops nobody claims run on `torch` (eager ATen kernels).
    transforms: trace passes (`transforms.trace_pass`, `mixed_precision`, ...), each running where it declares, and
        model-changing transforms (`quantize`, `fsdp`, `materialize`), applied to the module now.
    fullgraph: raise `GraphBreakError` instead of splitting the graph at a graph break.
    dynamic: as in `torch.compile` (None: Dynamo's automatic dynamic shapes).
    cache: look up and store compiled artifacts on disk (`PIPELINE_CACHE_DIR`; `PIPELINE_CACHE=0`: off everywhere).
    cuda_graphs: record each stage as a CUDA graph and replay it, per input shape (`dynamic` defaults to False); as with
        mode="reduce-overhead", the next step overwrites a step's outputs: keep them with `.item()` or `.clone()`.
    fallback: "warn" (default) or "raise": what a fallback (pipeline/fallbacks.py) does.
    autotune: a region several listed executors take whole runs on the fastest, timed at its first call (`regions`).
    """
    if not callable(model_or_fn):
        raise TypeError(f"pipeline.jit needs an nn.Module or a function, got {type(model_or_fn).__name__}")
    if isinstance(model_or_fn, (JittedModule, JittedFunction)):
        raise TypeError("this model is already jitted; jit the original instead")
    if moved := [p for p in getattr(model_or_fn, "parameters", list)() if hasattr(p, "pipeline_replaced_by")]:
        raise ValueError(f"this model's parameters were replaced by an earlier jit's {moved[0].pipeline_replaced_by} and"
                         " live in that jitted model now: use that one, or jit a fresh copy of the model")
    if dynamic not in (None, True, False):
        raise TypeError(f"dynamic must be None, True or False, got {dynamic!r}")
    for name, value in (("fullgraph", fullgraph), ("cache", cache), ("cuda_graphs", cuda_graphs), ("autotune", autotune)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if fallback not in MODES:
        raise TypeError(f"fallback must be one of {MODES}, got {fallback!r}")
    if isinstance(transforms, (str, TracePass)) or not hasattr(transforms, "__iter__"):
        raise TypeError(f"transforms must be a list of trace passes, got {transforms!r}")
    if cuda_graphs and dynamic is None:
        dynamic = False  # one graph per input shape (a stage with dynamic shapes cannot be recorded)
    usable, skipped = resolve(executors)
    resolved = [e.for_model() for e in usable]
    passes, replaced = _apply_transforms(model_or_fn, list(transforms))
    hooks = tuple(e.before_call for e in resolved if type(e).before_call is not Executor.before_call)
    state = CompileState(JitConfig(executors=tuple(resolved), passes=tuple(passes), owners=_owners(model_or_fn),
                                   replaced=replaced, fullgraph=fullgraph, dynamic=dynamic, cache=cache,
                                   cuda_graphs=cuda_graphs, fallback=fallback, call_hooks=hooks, autotune=autotune))
    for message in skipped:  # a listed executor missing here is a fallback: counted, warned, or raised
        report_fallback(state, message)
    if not isinstance(model_or_fn, torch.nn.Module):
        return JittedFunction(model_or_fn, state)
    again = functools.partial(jit, executors=executors, transforms=[t for t in transforms if not isinstance(t, Materialize)],
                              fullgraph=fullgraph, dynamic=dynamic, cache=cache, cuda_graphs=cuda_graphs,
                              fallback=fallback, autotune=autotune)
    return JittedModule(model_or_fn, state, again)


def _runner(model_or_fn, state: CompileState):
    """What compiles and runs it. Each has its own backend object, which Dynamo's guards tell apart."""
    if differentiates_inside(model_or_fn):  # Dynamo would break the graph at autograd.grad
        return GradCapture(model_or_fn, state)
    return torch.compile(model_or_fn, backend=PipelineBackend(state), fullgraph=state.config.fullgraph,
                         dynamic=state.config.dynamic, **_own_recompile_budget())


def _own_recompile_budget() -> dict:
    """Each jit its own Dynamo cache entries and recompile limit: Dynamo keys code on the code object (`Model.forward`,
    shared by a class's instances), so the 9th jitted instance of a class would hit the limit (8) and run uncompiled.
    torch 2.11 lacks the option: the limit grows by one per jit (`_jits`); a hit limit is reported (`_DynamoGiveUps`)."""
    global _jits
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        return {"isolate_recompiles": True}
    _jits += 1
    if _jits > 1 and torch._dynamo.config.recompile_limit < 8 + _jits:
        torch._dynamo.config.recompile_limit = 8 + _jits
    return {}


_jits = 0


class _DynamoGiveUps(logging.Handler):
    """What Dynamo logs when it stops compiling a frame (its recompile limit, say): a fallback in `compile_stats`."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.calls: list[list[str]] = []  # one list per jitted call in progress

    def emit(self, record: logging.LogRecord) -> None:
        if self.calls:
            self.calls[-1].append(record.getMessage())


_give_ups = _DynamoGiveUps()
logging.getLogger("torch._dynamo.convert_frame").addHandler(_give_ups)


def _apply_transforms(model_or_fn, transforms: list) -> tuple[list[TracePass], dict]:
    """Materializes meta tensors, applies model-changing transforms (stage 2); returns the passes and what was replaced."""
    removed = {name for t in transforms if isinstance(t, Without) for name in t.names}
    transforms = [t for t in transforms if not isinstance(t, Without)]
    preparations = [t for t in transforms if isinstance(t, Materialize)]
    model_transforms = [t for t in transforms if isinstance(t, ModelTransform)]
    passes = [as_pass(t) for t in transforms if not isinstance(t, (ModelTransform, Materialize))]
    if len(preparations) > 1:  # they would mix their files and devices
        raise ValueError(f"list materialize once, not {len(preparations)} times: {[p.name for p in preparations]}")
    if (preparations or model_transforms) and not isinstance(model_or_fn, torch.nn.Module):
        raise TypeError(f"{(preparations + model_transforms)[0].name} changes a module's parameters; jit an nn.Module")
    if model_transforms and differentiates_inside(model_or_fn):
        raise NotImplementedError(f"{model_transforms[0].name} does not combine yet with models that "
                                  f"call torch.autograd.grad in forward")
    replaced, from_file = {}, [p for p in preparations if p.checkpoint]
    if from_file and model_transforms:  # transforms read only the slices they keep, straight from the file
        from safetensors import safe_open
        with safe_open(from_file[0].checkpoint, framework="pt") as reader:
            replaced = model_state.apply(model_or_fn, model_transforms, reader, from_file[0].device)
    for preparation in preparations:  # real storage before capture
        preparation.prepare_module(model_or_fn, skip=frozenset(replaced))
    if model_transforms and not replaced:
        replaced = model_state.apply(model_or_fn, model_transforms)
    passes += [as_pass(p) for t in model_transforms for p in t.passes()]
    return with_defaults(passes, removed), replaced


def _owners(obj) -> dict[int, tuple[str, str]]:
    if not isinstance(obj, torch.nn.Module):
        return {}
    return {**{id(b): (InputKind.BUFFER, n) for n, b in obj.named_buffers(remove_duplicate=False)},
            **{id(p): (InputKind.PARAMETER, n) for n, p in obj.named_parameters(remove_duplicate=False)}}


def _call(jitted, args, kwargs):
    """Runs the compiled callable; notes graph breaks and capture time when this call compiled."""
    from torch._dynamo.utils import counters
    state, hooked = jitted._state, _any_global_module_hook()
    if (runner := jitted._runners.get(hooked)) is None:  # one for calls without global module hooks, one for calls with
        runner = jitted._runners[hooked] = _runner(jitted._original, state)
    config, history = state.config, state.history
    if config.dynamic is None and not history.generalized and not isinstance(runner, GradCapture):
        _generalize_on_shape_change(history, args, kwargs)
    for hook in config.call_hooks:
        hook()
    if config.autotune:
        save_changed()  # the choices the last call's backward made
    if config.cuda_graphs and isinstance(runner, GradCapture):
        # a new step for the CUDA graph trees, which count Dynamo's frame entries; this path has none
        torch._dynamo.mutation_guard.GenerationTracker.generation += 1
    n_records, n_fallbacks = len(history.records), len(history.fallbacks)
    breaks_before = _raw_break_counts(counters)  # cheap copies; parsed only if this call compiled
    start = time.perf_counter()
    _give_ups.calls.append([])
    try:
        with old_objects_frozen(on=not history.calls):  # the first call: Dynamo's capture too
            out = runner(*args, **kwargs)
    except torch._dynamo.exc.Unsupported as e:
        if config.fullgraph:
            raise GraphBreakError(_graph_break_message(e)) from e
        raise
    except torch._dynamo.exc.BackendCompilerFailed as e:
        if isinstance(e.inner_exception, (PassError, PipelineFallbackError)):  # say it plainly
            raise e.inner_exception.with_traceback(None) from None
        raise
    finally:
        gave_up = _give_ups.calls.pop()
        if history.hook_guards_lent:  # back to Dynamo's default for other code, once this call's guards are built
            torch._dynamo.config.skip_nnmodule_hook_guards, history.hook_guards_lent = True, False
    history.calls += 1
    if config.autotune:
        save_changed()
    compiled_nothing = not history.records and history.calls == 1 and len(history.fallbacks) == n_fallbacks
    if len(history.records) != n_records or compiled_nothing:
        history.generation += 1
        for record in history.records[n_records:]:
            record.generation = history.generation
        ran = ("total", "first call (forward)", "first call (inference)", "autotune (measuring)")  # not capture
        backend = sum(r.seconds.get(k, 0.0) for r in history.records[n_records:] for k in ran)
        history.capture_seconds += time.perf_counter() - start - backend
        before = _break_counts(breaks_before)
        for reason, count in _break_counts(_raw_break_counts(counters)).items():
            history.graph_breaks += [reason] * (count - before.get(reason, 0))
        _note_recompile_reasons(history.records[n_records:])
    if compiled_nothing and not gave_up:  # Dynamo found nothing to compile, and said nothing
        gave_up = [f"the first call compiled no graph (graph breaks: {'; '.join(history.graph_breaks) or 'none'})"]
    for message in gave_up:
        report_fallback(state, "Dynamo stopped compiling a frame, which runs in eager: "
                        + " ".join(message.split("\n")[:3]))
    return out


def _any_global_module_hook() -> bool:
    """Dynamo guards global module hooks (register_module_forward_hook, ...) only where its capture saw some."""
    m = torch.nn.modules.module
    return bool(m._global_forward_pre_hooks or m._global_forward_hooks
                or m._global_backward_pre_hooks or m._global_backward_hooks)


def _generalize_on_shape_change(history: CallHistory, args, kwargs) -> None:
    """Automatic dynamic, in one step: at the first call whose input shapes differ from the first's, every dim of a
    changed input becomes dynamic except a float tensor's last (its feature size), so a new batch size, then a new
    sequence length, cost one recompilation, not one each. Tensors in containers are left to Dynamo's own."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]  # cheap: every call
    shapes = tuple(tuple(t.shape) for t in tensors)
    if history.first_shapes is None:
        history.first_shapes = shapes
    if shapes == history.first_shapes:
        return
    for t, first in zip(tensors, history.first_shapes):
        if tuple(t.shape) != first and t.dim() > 0:
            last = t.dim() - 1 if t.is_floating_point() and t.dim() > 1 else t.dim()
            torch._dynamo.maybe_mark_dynamic(t, list(range(last)))
    history.generalized = True


def _note_recompile_reasons(records) -> None:
    """Dynamo's compilation metrics say which guard failed for each recompilation."""
    from torch._dynamo.utils import get_compilation_metrics
    reasons = {str(m.compile_id): m.recompile_reason for m in get_compilation_metrics()
               if getattr(m, "recompile_reason", None)}
    for record in records:
        record.recompile_reason = reasons.get(record.compile_id)


def _raw_break_counts(counters) -> dict[str, dict[str, int]]:
    """Dynamo files graph breaks under "graph_break" or, for unsupported constructs, "unimplemented"."""
    return {key: dict(counters[key]) for key in ("graph_break", "unimplemented")}


def _break_counts(raw: dict[str, dict[str, int]]) -> dict[str, int]:
    out = collections.Counter()
    for per_reason in raw.values():
        for reason, count in per_reason.items():
            out[reason.strip().splitlines()[0]] += count
    return out


def _graph_break_message(e) -> str:
    frames = getattr(e, "real_stack", None) or []
    where = f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else "unknown line"
    reason = getattr(e, "gb_type", None) or str(e).splitlines()[0]
    return (f"graph break with fullgraph=True: {reason} at {where}. Remove the break (see below), or "
            f"jit with fullgraph=False to split the model into several graphs.\n{e}")


class JittedModule(torch.nn.Module):
    """A compiled `nn.Module`: shares parameters, buffers and submodules with the original (so
    `parameters()`, `state_dict()`, `train()`, `eval()` and optimizers work on the original tensors)."""

    def __init__(self, model: torch.nn.Module, state: CompileState, again: Callable):
        super().__init__()
        self.__dict__.update(_original=model, _runners={}, _state=state, _again=again)  # not submodules (`_call`)
        self._parameters, self._buffers, self._modules = model._parameters, model._buffers, model._modules
        self._non_persistent_buffers_set, self.training = model._non_persistent_buffers_set, model.training

    def __setattr__(self, name: str, value) -> None:
        """Set on the original, which the compiled code reads (`cm.scale = 2`); the wrapper's own fields on itself."""
        super().__setattr__(name, value) if name in self.__dict__ else setattr(self._original, name, value)

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name) if name in self.__dict__ else delattr(self._original, name)

    def forward(self, *args, **kwargs):
        return _call(self, args, kwargs)

    def train(self, mode: bool = True):
        frozen = sorted({r.transform.name for r in self._state.config.replaced.values() if not r.transform.trainable})
        if mode and frozen:  # quantized weights do not train: only the other parameters would
            raise RuntimeError(f"this model was changed by {frozen}, whose tensors are frozen (inference only); "
                               f"train the original model, or jit it without {frozen[0]}")
        self._original.train(mode)
        self.training = mode
        return self

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The compiled code's parameters: the original's, each replaced one as its new tensors (`fc.weight.q`, ...)."""
        replaced = self._state.config.replaced
        for name, param in self._original.named_parameters(recurse=recurse, remove_duplicate=remove_duplicate):
            if name not in replaced:
                yield prefix + name, param
            else:
                yield from ((prefix + f"{name}.{suffix}", t) for suffix, t in replaced[name].tensors.items())

    def _apply(self, fn, recurse=True):
        """`.to()`, `.cuda()`, `.double()`, ... also reach the tensors model transforms own."""
        super()._apply(fn, recurse)
        for r in self._state.config.replaced.values():
            for tensor in r.tensors.values():
                tensor.data = fn(tensor.data)
            dtype = fn(torch.zeros(1, dtype=r.original.dtype)).dtype  # `original` stays on meta
            r.original = torch.empty(r.original.shape, dtype=dtype, device="meta")
        return self

    def __deepcopy__(self, memo):
        """A copy of the model jitted again: its own parameters and compiled state (the cache makes it start warm)."""
        if self._state.config.replaced or any(e.extra_state() for e in self._state.config.executors):
            raise TypeError("copy.deepcopy of a jitted model whose transforms or executors hold state of their own "
                            "(quantize, fsdp, fp8 scaling): deep-copy the original model before jit, and jit the copy")
        twin = self._again(copy.deepcopy(self._original, memo))
        own = {k: v for k, v in self.__dict__.items() if k not in twin.__dict__ or "hook" in k}
        twin.__dict__.update(copy.deepcopy(own, memo))  # hooks registered on the jitted model, attributes set on it
        return twin

    def __copy__(self):  # a second handle on the same jitted model (`__reduce_ex__` refuses pickling, not this)
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        return twin

    def __reduce_ex__(self, protocol):
        raise TypeError("a jitted model does not pickle (its compiled code belongs to this process): save "
                        "cm.state_dict() or pipeline.save(cm, path), and jit the model again where it is loaded")

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        """The original's state dict (keys, full shapes) whatever transforms did; `prefix`, `destination` as torch's."""
        config = self._state.config
        own = model_state.state_dict(self._original.state_dict(keep_vars=keep_vars), config.replaced, config.executors)
        out = destination if destination is not None else collections.OrderedDict()
        out.update((prefix + k, v) for k, v in own.items())
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if taken := set().union(*(e.load_extra_state(state_dict) for e in self._state.config.executors)):
            state_dict = {k: v for k, v in state_dict.items() if k not in taken}
        if self._state.config.replaced:
            return model_state.load_state_dict(self._original, state_dict, self._state.config.replaced, strict)
        return self._original.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            attribute = getattr(object.__getattribute__(self, "_original"), name)
        if name == "generate" and callable(attribute):  # Hugging Face's decoding loop
            return self._uncompiled_generate(attribute)
        return attribute

    def _uncompiled_generate(self, generate):
        """`generate` calls the original forward in its own loop, which is not captured: it runs uncompiled, and says so."""
        @functools.wraps(generate)
        def run(*args, **kwargs):
            if not any(m.startswith("generate()") for m in self._state.history.fallbacks):  # once a model
                report_fallback(self._state, "generate() runs the original model uncompiled (its decoding "
                                            "loop calls the model's own forward); call the jitted model for compiled steps")
            return generate(*args, **kwargs)
        return run

    def extra_repr(self) -> str:
        return f"executors={[e.name for e in self._state.config.executors]}"


class JittedFunction:
    def __init__(self, fn: Callable, state: CompileState):
        functools.update_wrapper(self, fn)
        self._original, self._runners, self._state = fn, {}, state

    def __call__(self, *args, **kwargs):
        return _call(self, args, kwargs)

    def __deepcopy__(self, memo):
        return self  # a function copies as itself (its compiled state holds FakeTensors, which do not copy)

    def __repr__(self) -> str:
        return f"<jitted {getattr(self._original, '__qualname__', self._original)!r}>"
