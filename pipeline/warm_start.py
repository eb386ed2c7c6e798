"""A warm start without lowering: AOTAutograd's own cache entry (`bundled_autograd_cache`) sealed in ours
(docs/cache.md, "A hit starts warm"); `record_entry` takes it on a cold compile, `load_entry` loads it on a hit."""

import contextlib
import contextvars
import dataclasses
import pickle
import time
from typing import Callable, Optional
from unittest import mock

import torch
import torch.fx as fx
from torch._inductor.output_code import OutputCode

from executors.dispatch import Assignment
from executors.plan import unbuilt
from ir import Trace

from . import trace_pickle

# the function that turns a loaded StageCode's trace into the callable it runs (set while loading)
_LOADER: contextvars.ContextVar[Optional[Callable]] = contextvars.ContextVar("pipeline_stage_loader", default=None)


class StageCode(OutputCode):
    """One compiled stage as AOTAutograd sees it (boxed). Pickles as its execution trace before its regions were
    built (`trace_pickle`), its ops' assignment, whether it can be a CUDA graph and the fingerprint of the lowered
    trace it came from; loading builds the regions again (artifact cache), without lowering or partitioning."""

    def __init__(self, run: Callable, stage: str, executed: Trace, lowered: str, assignment: Assignment,
                 why_not: Optional[str]):
        self._boxed_call = True  # an instance attribute: wrappers (functools.wraps) copy __dict__ only
        self.run, self.stage, self.executed, self.lowered = run, stage, executed, lowered
        self.assignment, self.why_not = assignment, why_not  # why_not: None, or why it is no CUDA graph
        self._graph_bytes, self._trace_fields = None, None  # set for pickling (prepare_for_serialization)
        self.boxed_code: Optional[tuple] = None  # the boxed stage's code (`boxed`), when it can be stored

    @torch._dynamo.disable(reason="a compiled stage: autograd may call the backward from a frame Dynamo captures")
    def __call__(self, inputs):
        return self.run(inputs)

    def __copy__(self):  # AOTAutograd copies a stage before preparing it for pickling
        new = object.__new__(StageCode)
        new.__dict__.update(self.__dict__)
        return new

    def prepare_for_serialization(self) -> None:
        t = self.executed
        self._graph_bytes = trace_pickle.dumps(unbuilt(t.module))
        self._trace_fields = (t.name, t.level, t.stage, t.inputs, t.outputs, t.provenance)
        self.boxed_code = t.module.meta.get("boxed_code")
        self.run = self.executed = None

    def __getstate__(self):
        if self._graph_bytes is None:
            raise TypeError("StageCode pickles only after prepare_for_serialization")
        return {"stage": self.stage, "lowered": self.lowered, "assignment": self.assignment, "why_not": self.why_not,
                "graph": self._graph_bytes, "trace": self._trace_fields, "boxed": self.boxed_code}

    def __setstate__(self, state):
        self.stage, self.lowered, self.assignment = state["stage"], state["lowered"], state["assignment"]
        self.why_not, self._graph_bytes, self._trace_fields = state["why_not"], state["graph"], state["trace"]
        self.boxed_code, self.run, self.executed, self._boxed_call = state["boxed"], None, None, True

    def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
        if self.run is not None:
            return
        if (loader := _LOADER.get()) is None:
            raise RuntimeError("a pipeline stage was loaded outside pipeline.warm_start.load_entry")
        name, level, stage, inputs, outputs, provenance = self._trace_fields
        self.executed = Trace(trace_pickle.loads(self._graph_bytes), name=name, level=level, stage=stage,
                              inputs=inputs, outputs=outputs, provenance=provenance)
        self.run = loader(self)

    def set_triton_bundle(self, triton_bundle) -> None:
        pass


def why_not(gm: fx.GraphModule, example_inputs) -> Optional[str]:
    """Why this captured graph cannot start warm (None: it can)."""
    if any(True for _ in gm.parameters()) or any(True for _ in gm.buffers()):
        return "the graph holds parameters or buffers of its own"
    if any(isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and not all(
            isinstance(s, int) for s in (*v.shape, *v.stride()))) for v in example_inputs):
        return "symbolic shapes"
    return None


@contextlib.contextmanager
def record_entry(key: str, on_entry: Callable[[bytes, float], None], on_failure: Callable[[str], None]):
    """While compiling with `aot_module_simplified`: AOTAutograd hands its bundled cache entry for this graph to
    `on_entry` (pickled, with the seconds pickling took), or says to `on_failure` why not. The backward compiles
    with the forward, so the entry is complete when this block ends; only the outermost compile is stored."""
    from torch._functorch import config as functorch_config
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._functorch._aot_autograd.schemas import AOTAutogradCacheInfo

    started = []

    def start(mod, args, aot_config, *rest, **kwargs):  # instead of a lookup: the key to save under
        frozen = dataclasses.is_dataclass(aot_config) and type(aot_config).__dataclass_params__.frozen
        if started:  # a nested AOTAutograd compile (an executor's own): not ours to store
            return (None, aot_config) if frozen else None
        started.append(key)
        info = AOTAutogradCacheInfo(key, time.time_ns(), forward_symints=[])
        if frozen:
            return None, dataclasses.replace(aot_config, cache_info=info)  # torch >= 2.12
        aot_config.cache_info = info  # torch 2.11
        return None

    def save(saved_key, entry, remote=False):
        if saved_key != key:
            return
        start = time.perf_counter()
        try:
            entry.pre_save()
            data = pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # e.g. a model class defined inside a function: not picklable
            on_failure(f"no warm start: the lowered graph does not pickle ({type(e).__name__}: {str(e)[:200]})")
            return
        on_entry(data, time.perf_counter() - start)

    patched = {"enable_autograd_cache": True, "bundled_autograd_cache": True, "force_non_lazy_backward_lowering": True}
    with (functorch_config.patch(patched), mock.patch.object(AOTAutogradCache, "try_load", staticmethod(start)),
          mock.patch.object(AOTAutogradCache, "save", staticmethod(save))):
        yield


def load_entry(data: bytes, loader: Callable[[StageCode], Callable]) -> Callable:
    """The compiled function of a stored entry; `loader(stage_code)` makes each stage's callable."""
    from torch._functorch._aot_autograd.aot_autograd_result import deserialize_bundled_cache_entry
    entry = pickle.loads(data)  # authentic: the caller read it from an entry sealed with our key
    token = _LOADER.set(loader)
    try:
        return deserialize_bundled_cache_entry(entry)
    finally:
        _LOADER.reset(token)
