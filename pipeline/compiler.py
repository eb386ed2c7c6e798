"""The Dynamo backend, per captured graph: capture → wrappers' pre_compile → passes → lowering, autodiff (AOTAutograd;
joint passes before its partitioner) → passes → executors (cached regions loaded) → wrappers' post_compile."""

import contextlib
import functools
import gc
import logging
import time
from typing import Callable, Sequence
from unittest import mock

import torch
import torch.fx as fx
from functorch.compile import min_cut_rematerialization_partition
from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
from torch._dynamo.exc import RestartAnalysis
from torch._functorch.aot_autograd import aot_module_simplified
from torch._guards import CompileContext, TracingContext

from executors import dispatch
from executors.donation import donated_stage_inputs, keeping_saved_tensors
from ir import OutputKind, OutputSpec, Stage, Step, Trace, TraceError, get_logger, verify
from ir.typecheck import check_types, structure
from transforms import TracePass
from transforms.group_linears import group_linears_in

from . import cuda_graphs, warm_start
from .cache import GraphCache
from .fallbacks import PipelineFallbackError, report_fallback
from .record import GraphRecord
from .runtime_wrappers import BoxedStage, graph_wrappers, post_compile_all, pre_compile_all, wrapper_metadata
from .warm_start import StageCode
from .specs import captured_input_specs, lowered_input_specs, lowered_output_specs


log = get_logger("compiler")


# Built-in passes an executor may ask for by name (`passes_before_prepare`): executors do not import `transforms`.
EXECUTOR_PASSES = {"group_linears": group_linears_in}


def _executor_passes(executor, trace: Trace) -> Trace:
    """`trace` through the built-in passes `executor` asks to run before its `prepare`."""
    for name in executor.passes_before_prepare():
        if name not in EXECUTOR_PASSES:
            raise ValueError(f"executor {executor.name!r} asks for pass {name!r} before prepare; "
                             f"built-in passes it may name: {sorted(EXECUTOR_PASSES)}")
        trace = EXECUTOR_PASSES[name](trace)
    return trace


class PassError(RuntimeError):
    """A trace pass raised, returned no Trace, edited its input, or returned a trace its ops do not compute."""


_gc_frozen = [False]  # by `old_objects_frozen`: a nested block then skips `get_freeze_count`'s O(heap) walk
# Python 3.12 parks its ~400 immortal objects among the frozen at each full GC; a program's gc.freeze() froze thousands
PYTHONS_OWN_FROZEN = 2000


@contextlib.contextmanager
def old_objects_frozen(on: bool = True):
    """Full GCs skip what predates this block (`gc.freeze`: each walks torch's heap) unless the program froze some.
    Only around work done once (a compile, a first call): frozen each step, a step's garbage would age to gen 2."""
    outermost = not _gc_frozen[0]
    if froze := on and (not outermost or gc.get_freeze_count() < PYTHONS_OWN_FROZEN):
        gc.freeze()  # nested: what the outer block made so far too
        _gc_frozen[0] = True
    try:
        yield
    finally:
        if froze and outermost:
            _gc_frozen[0] = False
            gc.unfreeze()  # Python's parked objects too: it parks them again


def _aot_graph_logs_off():
    """AOTAutograd renders its graphs as text for its logs even with none on (~5% of lowering): not unless asked."""
    from torch._functorch._aot_autograd import graph_compile as g
    from torch._logging._internal import trace_log
    if trace_log.handlers or g.aot_graphs_log.isEnabledFor(logging.INFO) or g.aot_joint_log.isEnabledFor(logging.INFO):
        return contextlib.nullcontext()
    return mock.patch.multiple(g, _log_joint_graph=lambda *a, **k: None, _log_fw_bw_graphs=lambda *a, **k: (None, None))


class PipelineBackend:
    """A `torch.compile` backend bound to one jitted model's state."""

    def __init__(self, state, *, level: str = "torch", capture: str = "capture"):
        self.state = state
        self.level = level        # "torch" for Dynamo graphs, "aten" for graphs traced with make_fx
        self.capture = capture    # the provenance name of the capture step

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence):
        state = self.state
        compile_id = CompileContext.current_compile_id()
        record = GraphRecord(f"g{len(state.history.records)}", str(compile_id) if compile_id else "?",
                             state.history.generation)
        recompile = compile_id is not None and bool(getattr(compile_id, "frame_compile_id", 0))
        state.history.recompiles += recompile
        state.history.records.append(record)
        if torch._dynamo.config.skip_nnmodule_hook_guards:  # by default a hook added (or removed) after this
            torch._dynamo.config.skip_nnmodule_hook_guards = False  # compile would be ignored; `jit._call` restores it
            state.history.hook_guards_lent = True
        start = time.perf_counter()
        log.info("%s: captured %d ops (Dynamo frame %s)", record.graph_id,
                 sum(n.op.startswith("call") for n in gm.graph.nodes), record.compile_id)
        try:
            with old_objects_frozen():
                return self._compile(gm, example_inputs, record)
        except (PassError, PipelineFallbackError, Warning):  # a Warning: warnings are errors here
            raise
        except RestartAnalysis:  # Dynamo's signal to capture this frame again (a Python float made a tensor)
            state.history.records.remove(record)
            state.history.recompiles -= recompile
            raise
        except Exception as e:  # model code the pipeline cannot lower runs in eager, loudly
            if state.config.replaced:  # the captured graph reads stand-ins for the transformed parameters
                raise RuntimeError(f"pipeline: graph {record.graph_id} of a model changed by "
                                   f"{sorted({r.transform.name for r in state.config.replaced.values()})} could "
                                   f"not be compiled, and cannot run in eager on the original parameters "
                                   f"(they were replaced): {type(e).__name__}: {e}") from e
            record.eager_fallback = f"{type(e).__name__}: {str(e).strip()[:500]}"
            report_fallback(state, f"graph {record.graph_id} runs in eager: {record.eager_fallback}", cause=e)
            return gm.forward
        finally:
            record.seconds["total"] += time.perf_counter() - start

    def _compile(self, gm, example_inputs, record: GraphRecord):
        state = self.state
        for node in gm.graph.nodes:  # Dynamo keeps fake values under "example_value"
            if "val" not in node.meta and "example_value" in node.meta:
                node.meta["val"] = node.meta["example_value"]
        captured = record.add_trace(Trace(gm, name=f"{record.graph_id}_captured", level=self.level,
                                          inputs=captured_input_specs(gm, example_inputs, state.config.owners),
                                          outputs=[OutputSpec(OutputKind.USER_OUTPUT)] * _num_outputs(gm),
                                          stage=Stage.CAPTURED, provenance=(Step(self.capture),)))
        cache = GraphCache.open(gm, example_inputs, state, record)
        wrappers = graph_wrappers(state)  # e.g. model-changing transforms (stage 2) feed their tensors
        trace, example_inputs = pre_compile_all(wrappers, captured, list(example_inputs), record)
        timed_verify(record, trace)
        metadata = wrapper_metadata(wrappers)
        bound = self._bound_again(cache, record)  # a warm start binds what prepare bound, without preparing
        if not (warm := bound and self._warm_start(cache, example_inputs, metadata, record)):
            trace, may_load = self._prepare(trace, cache, record)
            warm = may_load and not bound and self._warm_start(cache, example_inputs, metadata, record)
        if warm:
            if bound:  # no "prepared" trace: the stored stages already hold what it made
                record.cache_notes.append("prepare not run: the executors bound again what the entry's prepare bound")
            return post_compile_all(wrappers, warm)
        trace = self._run_passes("before_autodiff", trace, record)
        recording = self._records_warm_start(cache, trace, example_inputs, record)
        stage = functools.partial(self._lower_stage, record=record, captured=trace, cache=cache, serializable=recording)
        # Serializable only while recording: else AOTAutograd consults torch's own cache (its dir and trust model).
        forward = functools.partial(stage, "forward")
        start, inner_before = time.perf_counter(), sum(record.seconds.values())
        with warm_start.record_entry(cache.key, cache.aot_entry_done, record.cache_notes.append) \
                if recording else contextlib.nullcontext(), _aot_graph_logs_off():
            compiled = aot_module_simplified(
                trace.module, list(example_inputs),
                fw_compiler=SerializableAOTDispatchCompiler(StageCode, forward) if recording else forward,
                bw_compiler=torch._dynamo.disable(functools.partial(stage, "backward"), reason="compiles lazily, at runtime"),
                inference_compiler=functools.partial(stage, "inference"),
                partition_fn=functools.partial(self._partition, record=record, captured=trace),
                decompositions={op: fn for ex in state.config.executors
                                for op, fn in ex.decompositions_before_partition().items()})
        record.seconds["lower"] += time.perf_counter() - start - (sum(record.seconds.values()) - inner_before)
        if cache is not None:
            cache.wrappers_done(wrapper_metadata(wrappers))
        return post_compile_all(wrappers, compiled)

    def _prepare(self, trace: Trace, cache, record: GraphRecord) -> tuple[Trace, bool]:
        """Each executor's `prepare` (model-level swaps, e.g. TE's linears). Its ops may name per-model state (TE's
        fp8 scaling): a stored entry loads only if made from the very same graph. Returns (trace, whether it may)."""
        rewrote, checks, notes, bound = [], [], [], {}
        start = time.perf_counter()
        for i, executor in enumerate(self.state.config.executors):
            prepared, its_notes = executor.prepare(_executor_passes(executor, trace))
            notes += its_notes
            if prepared is not trace:
                checks.append((trace, prepared, f"{executor.name}.prepare"))
                trace = record.add_trace(prepared)
                rewrote.append(f"{executor.name}.prepare")
                bound[i] = executor.binding()
        record.fallbacks += notes
        record.seconds["prepare"] += time.perf_counter() - start
        if cache is not None and rewrote:
            cache.entry.update(prepared=trace.fingerprint(), prepare_notes=notes,
                               bound=None if None in bound.values() else bound)
        stored = cache.stored if cache is not None else None
        if stored is not None and stored.get("prepared") == cache.entry.get("prepared"):
            return trace, True
        for before, after, step in checks:  # else the very graph that passed them when it was stored
            check_built_in(before, after, step, record)
        if stored is not None:
            record.cache_notes.append(f"no warm start: {', '.join(rewrote) or 'prepare'} made another graph than "
                                      f"the stored one (its ops name per-model state: another jit order?)")
        return trace, False

    def _bound_again(self, cache, record: GraphRecord) -> bool:
        """Whether, for a stored entry of this very graph, each executor whose `prepare` rewrote it bound again what it
        had bound (`bind_again`: TE's fp8 scaling state), so that its stages load without preparing."""
        stored = cache.stored if cache is not None else None
        if not stored or stored.get("bound") is None:
            return False
        start, executors = time.perf_counter(), self.state.config.executors
        if bound := all(executors[i].bind_again(binding) for i, binding in stored["bound"].items()):
            record.fallbacks += stored["prepare_notes"]
            cache.entry.update({key: stored[key] for key in ("prepared", "prepare_notes", "bound")})
        record.seconds["prepare"] += time.perf_counter() - start
        return bound

    def _warm_start(self, cache, example_inputs, wrappers: list, record: GraphRecord):
        """The stored entry's compiled function, not lowered (`warm_start`); None if it has none or fails to load."""
        stored = cache.stored if cache is not None else None
        if not stored or not stored.get("aot") or stored.get("wrappers") != wrappers:
            return None
        start, inner_before = time.perf_counter(), sum(record.seconds.values())
        kept_traces, kept_regions = len(record.traces), len(record.regions)
        loader = functools.partial(self._load_stage, record=record, cache=cache)
        try:
            compiled = warm_start.load_entry(stored["aot"], loader)
        except Exception as e:  # a stale entry (another torch): compile as if it were not there
            record.cache_notes.append(f"warm start failed ({type(e).__name__}: {str(e)[:200]}); compiled")
            log.info("%s: warm start failed: %s", record.graph_id, e, exc_info=True)
            del record.regions[kept_regions:], record.traces[kept_traces:]
            return None
        record.seconds["cache"] += time.perf_counter() - start - (sum(record.seconds.values()) - inner_before)
        cache.entry["aot"] = stored["aot"]
        cache.wrappers_done(wrappers)
        log.info("%s: warm start: loaded without lowering", record.graph_id)
        return compiled

    def _load_stage(self, code: StageCode, *, record: GraphRecord, cache) -> Callable:
        return self._execute(code.stage, code.executed, [], [n.meta.get("val") for n in code.executed.placeholders()],
                             record=record, cache=cache, lowered=code.lowered, loaded=code)[0]

    def _records_warm_start(self, cache, trace: Trace, example_inputs, record: GraphRecord) -> bool:
        """Whether AOTAutograd's own entry for this graph is stored in ours while it lowers."""
        why_not = warm_start.why_not(trace.module, example_inputs) if cache is not None else "no cache"
        if why_not is not None and cache is not None:
            record.cache_notes.append(f"no warm start: {why_not}")
        return why_not is None

    def _partition(self, joint: fx.GraphModule, joint_inputs, *, record, captured, **kwargs):
        """AOTAutograd's partition hook: the joint passes (default `save_policy` too), then the min-cut partitioner."""
        own = [TracePass(fn, runs_on="joint", name=f"{ex.name}.{fn.__name__}", optional=True)
               for ex in self.state.config.executors for fn in ex.joint_passes()]
        if own or any(p.runs_on == "joint" for p in self.state.config.passes):
            trace = Trace(joint, name=f"{record.graph_id}_joint", level="aten", stage=Stage.JOINT,
                          inputs=lowered_input_specs(joint, captured.inputs, Stage.JOINT),
                          outputs=lowered_output_specs(joint, captured.inputs, Stage.JOINT,
                                                       num_forward_outputs=kwargs["num_fwd_outputs"]),
                          provenance=captured.provenance + (Step("lower (joint)"),))
            trace = self._run_passes("joint", record.add_trace(trace), record, first=own)
            joint = trace.module
        with torch._functorch.config.patch(graphsafe_rng_functionalization=False):  # see _rng_wrappers_typed
            stages = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        _rng_wrappers_typed(stages)
        return stages

    @old_objects_frozen()  # a backward stage compiles lazily, at the first backward: outside __call__
    def _lower_stage(self, stage: str, gm: fx.GraphModule, example_inputs, *, record: GraphRecord,
                     captured: Trace, cache: GraphCache | None, serializable: bool = False):
        """AOTAutograd's compiler hook for the forward, backward or inference graph."""
        meta = getattr(TracingContext.try_get(), "fw_metadata", None)
        trace = Trace(gm, name=f"{record.graph_id}_{stage}", level="aten", stage=Stage(stage),
                      inputs=lowered_input_specs(gm, captured.inputs, stage),
                      outputs=lowered_output_specs(gm, captured.inputs, stage, meta),
                      provenance=captured.provenance + (Step(f"lower ({stage})"),))
        record.add_trace(timed_verify(record, trace))
        log.info("%s %s: lowered to %d ATen ops", record.graph_id, stage, len(trace.ops()))
        lowered = trace.fingerprint() if cache is not None else ""
        # Saved activations nothing reads after the backward (AOTAutograd's donated buffers): the region reading one
        # last may reuse its memory, as in torch.compile; kept by name, as the passes may add or reorder inputs.
        positions = set(getattr(meta, "bw_donated_idxs", None) or []) if stage == "backward" else set()
        donated_names = {n.name for i, n in enumerate(trace.placeholders()) if i in positions}
        trace = self._run_passes("after_autodiff", trace, record)
        donated = [i for i, n in enumerate(trace.placeholders()) if n.name in donated_names]
        run, executed, assignment, why_not = self._execute(stage, trace, donated, example_inputs, record=record,
                                                           cache=cache, lowered=lowered)
        if positions:  # torch refuses a backward that keeps the graph; the stage copies what it overwrites instead
            meta.bw_donated_idxs = []
        return StageCode(run, stage, executed, lowered, assignment, why_not) if serializable else run

    def _execute(self, stage: str, trace: Trace, donated: list, example_inputs, *, record: GraphRecord,
                 cache: GraphCache | None, lowered: str, loaded: StageCode | None = None) -> tuple:
        """A stage's trace dispatched to the executors (regions loaded from the artifact cache if there), boxed, a CUDA
        graph if asked; or a `loaded` stage's regions rebuilt. Returns (fn, execution trace, assignment, why_not)."""
        start = time.perf_counter()
        execution = dispatch(trace, self.state.config.executors, stage=stage, graph_id=record.graph_id,
                             first_region_id=sum(len(r.regions) for r in self.state.history.records),
                             artifacts=cache.artifacts if cache is not None else None, donated=donated,
                             on_fallback=functools.partial(report_fallback, self.state),
                             autotune=functools.partial(_raced, record, cache) if self.state.config.autotune else None,
                             partitioned=loaded.assignment if loaded else None)
        record.seconds["dispatch"] += time.perf_counter() - start - execution.autotune_seconds
        if execution.autotune_seconds:
            record.seconds["autotune"] += execution.autotune_seconds
        for region in execution.regions:
            record.seconds["dispatch"] -= region.compile_seconds
            where = "cache load" if region.id in execution.loaded else f"compile:{region.executor}"
            record.seconds[where] += region.compile_seconds
        record.regions += execution.regions
        for region in execution.regions:
            if region.fallback_reason and "failed to compile" in region.fallback_reason and region.compiled_as is None:
                report_fallback(self.state, f"region {region.id} ({record.graph_id} {stage}) runs on "
                                f"{region.executor}: {region.fallback_reason}")
        record.fallbacks += execution.assignment.fallbacks
        record.decomposed += execution.assignment.decomposed
        executed = record.add_trace(execution.trace)
        if cache is not None:
            cache.stage_done(stage, lowered, execution, executed)
        fn = BoxedStage(loaded.boxed_code if loaded else None).post_compile(executed.module)
        why_not = None
        if self.state.config.cuda_graphs:
            why_not = loaded.why_not if loaded else cuda_graphs.why_not_recordable(
                trace, example_inputs, self.state.config.executors)
            fn = cuda_graphs.stage_callable(fn, executed, example_inputs, why_not, stage=stage, record=record)
        if stage == "backward":
            fn = keeping_saved_tensors(fn, donated_stage_inputs(executed.module), record.cuda_graphs.get(stage) == "on")
        fn = _timing_first_call(fn, record, stage)
        if stage == "backward":  # autograd may call it from a frame Dynamo is capturing (`loss.backward()` in a jitted step)
            fn = torch._dynamo.disable(fn, reason="the pipeline's compiled backward")
        return fn, executed, execution.assignment, why_not

    def _run_passes(self, where: str, trace: Trace, record: GraphRecord, first=()) -> Trace:
        for p in (*first, *self.state.config.passes):
            if p.runs_on == where and (out := run_pass(p, trace, record)) is not trace:
                trace = record.add_trace(out)
        return trace


def _timing_first_call(fn: Callable, record: GraphRecord, stage: str) -> Callable:
    """The boxed stage `fn`, its first call (kernel loading, CUDA graph warm-up) timed as "first call (<stage>)"."""
    def run(args: list):
        if not calls:
            return fn(args)
        calls.pop()
        start, measuring = time.perf_counter(), record.seconds.get("autotune (measuring)", 0.0)
        try:
            with old_objects_frozen():  # CUDA-graph recording, kernels loaded: new objects only
                return fn(args)
        finally:  # autotune's measuring is counted as autotune's
            measuring = record.seconds.get("autotune (measuring)", 0.0) - measuring
            record.seconds[f"first call ({stage})"] += time.perf_counter() - start - measuring
    calls = [1]
    run._boxed_call = True
    return run


def _raced(record: GraphRecord, cache: GraphCache | None, seconds: float) -> None:
    """A raced region chose its executor (autotune): what measuring took; the entry holds the choice."""
    record.seconds["autotune (measuring)"] += seconds
    if cache is not None:
        cache.changed()


def run_pass(p: TracePass, trace: Trace, record: GraphRecord) -> Trace:
    """Runs `p`, checked (a new, valid Trace; its input untouched); an optional pass that fails is skipped, noted."""
    try:
        return _run_checked(p, trace, record)
    except PassError as e:
        if not p.optional:
            raise
        record.fallbacks.append((p.name, f"not applied: {e}"))
        return trace


def _run_checked(p: TracePass, trace: Trace, record: GraphRecord) -> Trace:
    before, start = structure(trace), time.perf_counter()
    try:
        out = p(trace)
    except PassError:
        raise
    except Exception as e:  # the user's pass is at fault: never a silent run without it
        raise PassError(f"pass {p.name!r} raised {type(e).__name__} on trace {trace.name!r}: {e}") from e
    seconds = time.perf_counter() - start
    if not isinstance(out, Trace):
        raise PassError(f"pass {p.name!r} returned {type(out).__name__}, not a Trace; "
                        f"build the result with trace.derive(gm, by=...)")
    if out is trace and p.optional:  # a default pass with nothing to do: no trace, no provenance
        record.seconds["passes"] += seconds
        return trace
    if structure(trace) != before:
        raise PassError(f"pass {p.name!r} changed its input trace {trace.name!r}; passes must edit "
                        f"a copy: gm = trace.editable(), then return trace.derive(gm, by=...)")
    start_check = time.perf_counter()
    try:
        verify(out)
        check_types(out, before=trace, pass_name=p.name, output_dtypes_may_change=p.output_dtypes_may_change)
    except TraceError as e:
        raise PassError(f"pass {p.name!r} returned a trace that does not check: {e}") from None
    record.seconds["passes"] += seconds
    record.seconds["verify"] += time.perf_counter() - start_check
    if len(out.provenance) <= len(trace.provenance):
        out = out.derive(out.module, by=p.name, seconds=seconds)
    return out


def check_built_in(before: Trace, after: Trace, step: str, record: GraphRecord) -> None:
    """The same checks as for a user's pass, for a rewrite the pipeline applies itself."""
    start = time.perf_counter()
    verify(after)
    check_types(after, before=before, pass_name=step)
    record.seconds["verify"] += time.perf_counter() - start


def timed_verify(record: GraphRecord, trace: Trace) -> Trace:
    start = time.perf_counter()
    verify(trace)
    record.seconds["verify"] += time.perf_counter() - start
    return trace


def _rng_wrappers_typed(stages) -> None:
    """The partitioner wraps a checkpoint's random ops so that the backward replays their RNG state, and leaves the
    wrappers without a value and the states with a symbolic size: each gets its value, the states their static size.
    On CUDA too: its graph-safe variant (generator inputs, for CUDA graphs) is off, so such a stage is not recorded."""
    rng = torch._prims.rng_prims
    for node in (n for gm in stages for n in gm.graph.nodes if n.op == "call_function"):
        if node.target is rng.run_and_save_rng_state:
            state, out = sorted(node.users, key=lambda u: u.args[1])
            state.meta["val"] = _static_size(state.meta["val"])
            node.meta["val"] = (state.meta["val"], out.meta["val"])
        elif node.target is rng.run_with_rng_state:
            node.args[0].meta["val"] = _static_size(node.args[0].meta["val"])
            args, kwargs = fx.map_arg((node.args[2:], node.kwargs), lambda n: n.meta["val"])
            with node.args[0].meta["val"].fake_mode:
                node.meta["val"] = node.args[1](*args, **kwargs)


def _static_size(state: torch.Tensor) -> torch.Tensor:
    size = state.shape[0].node.hint if isinstance(state.shape[0], torch.SymInt) else state.shape[0]
    with state.fake_mode:
        return torch.empty(size, dtype=state.dtype, device=state.device)


def _num_outputs(gm: fx.GraphModule) -> int:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    return len(out) if isinstance(out, (tuple, list)) else 1
