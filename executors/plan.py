"""`dispatch`: an ATen trace becomes an execution trace of compiled regions (printable, runnable), a `Region` each."""

import contextlib
import dataclasses
import functools
import operator
import time
import warnings
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from ir import PipelineFallbackWarning, PipelineWarning, Region, Step, Trace, describe_value, get_logger, node_value
from ir.symbols import check_symbols_bound

from .autotune import Race, why_not_raced
from .base import Executor, RegionDeclined
from .graph_utils import op_name
from .dispatch import Assignment, assign
from .donation import mark_donated_inputs
from .partition import keep_islands_whole, partition
from .compiled_region import CompiledRegion
from .region_keys import region_key, structure_key
from .result_check import ResultCheck
from .torch_executor import torch_executor


log = get_logger("dispatch")


@dataclasses.dataclass
class RegionArtifact:
    """An artifact-cache entry: an executor's bytes (`load_region`), loaded only for its region graph (`structure`)."""
    executor: str
    data: bytes
    fallback_reason: Optional[str] = None
    structure: str = ""
    race: Optional[dict] = None  # autotune: each candidate's median ms; `executor` is the choice


@dataclasses.dataclass
class Execution:
    trace: Trace
    regions: list[Region]
    assignment: Assignment
    loaded: set[int] = dataclasses.field(default_factory=set)  # ids of regions rebuilt from `artifacts`
    uncached: list[str] = dataclasses.field(default_factory=list)  # why a region was not stored
    autotune_seconds: float = 0.0  # compiling the candidates that were not listed first


def dispatch(trace: Trace, executors: Sequence[Executor], *, stage: str, graph_id: str = "",
             fallback: Executor = torch_executor, first_region_id: int = 0,
             artifacts: Optional[dict[str, RegionArtifact]] = None,
             donated: Sequence[int] = (), on_fallback: Optional[Callable[[str], None]] = None,
             autotune: Optional[Callable[[float], None]] = None, partitioned: Optional[Assignment] = None) -> Execution:
    """Assigns, partitions and compiles `trace`. `artifacts`: the artifact cache, loaded from and filled. `donated`:
    indices of inputs nothing reads after this stage (`bw_donated_idxs`). `on_fallback(message)`: told when a wrong
    first result moves a region to a later executor. `autotune(seconds)`: races regions several `executors` take, told
    what measuring took. `partitioned`: the assignment, `trace` being an `unbuilt` module (a warm start)."""
    gm = trace.editable() if partitioned is None else trace.module
    steps: list[Step] = []

    def step(name: str, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        steps.append(Step(f"dispatch: {name}", time.perf_counter() - start))
        return out
    order = list(executors) + ([fallback] if all(e.name != fallback.name for e in executors) else [])
    if partitioned is None:
        assignment = step("assign claims", assign, gm, executors, fallback)
        step("keep fusible islands whole", keep_islands_whole, gm, order, fallback.name)
        named = step("partition", partition, gm, order)
        if donated:
            step("mark donated inputs", mark_donated_inputs, gm, donated,
                 {e.name for e in order if e.outputs_may_alias_inputs})
    else:
        assignment, named = partitioned, [(n.target, n.meta["executor"]) for n in gm.graph.nodes if n.op == "call_module"]
    builder = _RegionBuilder(gm, order, fallback, stage, graph_id, artifacts, on_fallback or _warn,
                             list(executors), autotune)
    regions = step("compile or load regions" + (" (warm start)" if partitioned else ""), builder.build_all,
                   named, first_region_id)
    for node in gm.graph.find_nodes(op="call_module"):  # its region's outputs, as its check expects them
        node.meta["val"] = tuple(gm.get_submodule(node.target).check.expected)
    gm.recompile()
    out = trace
    for s in steps:
        out = out.derive(gm, by=s.name, seconds=s.seconds, name=trace.name)
    return Execution(out, regions, assignment, builder.loaded, builder.uncached, builder.autotune_seconds)


class _RegionBuilder:
    """Builds each `CompiledRegion`: from its twin (an identical one built before), the artifact cache, or executors."""

    def __init__(self, gm, order, fallback, stage, graph_id, artifacts, on_fallback, listed, autotune):
        self.gm, self.order, self.fallback, self.stage, self.graph_id = gm, order, fallback, stage, graph_id
        self.artifacts, self.on_fallback, self.by_name = artifacts, on_fallback, {e.name: e for e in order}
        self.loaded, self.uncached, self.autotune_seconds = set(), [], 0.0  # for `Execution`
        self.compiled: dict[tuple, tuple[Callable, Region]] = {}  # (executor, structure) -> first built
        self.replaced: dict[tuple, tuple[Callable, Region]] = {}  # the same, for wrong results
        self.listed, self.autotune = listed, autotune  # autotune races among `listed` (not the fallback)
        self.keys: dict[int, str] = {}  # id(region source) -> its structure_key
        self.described: dict[tuple, Region] = {}  # (id(region source), executor) -> its row, as `_describe` made it
        self.unfinished: list[tuple] = []  # compiled regions with work left running (`finish_region`)

    def build_all(self, named, first_region_id: int) -> list[Region]:
        regions = []
        for k, (sub_name, ex_name) in enumerate(named):
            source = self.gm.get_submodule(sub_name)
            if (id(source), ex_name) not in self.described:  # a warm start's twins share one source: described once
                self.described[id(source), ex_name] = _describe(source, self.stage, ex_name, self.graph_id, self.order)
            region = dataclasses.replace(self.described[id(source), ex_name], id=first_region_id + k)
            try:  # and hashed once
                if id(source) not in self.keys:
                    self.keys[id(source)] = structure_key(source)
                structure, why_no_key = self.keys[id(source)], None
            except Exception as e:  # e.g. a constant without data: compiled, not cached
                structure, why_no_key = None, f"{type(e).__name__}: {e}"
            twin = self.compiled.get((ex_name, structure)) if structure else None
            if twin is not None:  # the same region one layer down: run the code built for the first
                fn, first = twin
                region.executor, region.fallback_reason, region.compiled_as = first.executor, first.fallback_reason, first.id
                region.race = first.race
                if first.id in self.loaded:  # for the cache, a twin of a loaded region is loaded too
                    self.loaded.add(region.id)
                if isinstance(fn, Race) and fn.chosen is None:
                    fn.regions.append(region)
            else:
                fn = self._load_or_compile(source, region, ex_name, structure, why_no_key)
                log.info("%s %s: region %d/%d (%d ops) %s by %s in %.2f s", self.graph_id, self.stage, k + 1,
                         len(named), region.op_count, "loaded" if region.id in self.loaded else "compiled",
                         region.executor, region.compile_seconds)
                if structure:
                    self.compiled[(ex_name, structure)] = (fn, region)
            replace = functools.partial(_replace_wrong_result, source=source, region=region, structure=structure,
                                        order=self.order, fallback=self.fallback, replaced=self.replaced,
                                        on_fallback=self.on_fallback)
            self.gm.add_submodule(sub_name, CompiledRegion(fn, region, source, replace))
            regions.append(region)
        self._finish_all()
        return regions

    def _finish_all(self) -> None:
        """Waits for work compiles left running (Inductor's kernels), then stores each region (a race once it chose).
        A candidate failing its wait leaves its race; a region left with none goes, loudly, to the next executor."""
        for fn, source, region, structure, key, failed in self.unfinished:
            start, race, problems = time.perf_counter() - region.compile_seconds, fn if isinstance(fn, Race) else None, []
            for name, candidate in list(race.candidates.items()) if race else [(region.executor, fn)]:
                try:
                    self.by_name[name].finish_region(candidate)
                except Exception as e:
                    problems.append(f"{name} failed to compile: {type(e).__name__}: {str(e).strip()[:300]}")
                    if race:
                        race.candidates.pop(name)
            if problems and race and race.candidates:  # until the race chooses, the first left runs it
                race.key, failed = None, True
                for r in race.regions:
                    r.executor = next(iter(race.candidates))
                    r.fallback_reason = "; ".join(filter(None, [r.fallback_reason, *problems]))
            elif problems:
                new = _replace_wrong_result("; ".join(problems), source=source, region=region, structure=structure,
                                            order=self.order, fallback=self.fallback, replaced=self.replaced,
                                            on_fallback=lambda message: None)  # reported as a failed compile
                for m in self.gm.children():  # the region and its twins
                    if isinstance(m, CompiledRegion) and m.fn is fn:
                        m.fn, m.region.executor, m.region.fallback_reason = new, region.executor, region.fallback_reason
                fn, failed, race = new, True, None
            region.compile_seconds = time.perf_counter() - start  # the compile, the wait, any replacement
            if key is not None and failed:  # it may compile next time (memory, a worker): not stored
                self.uncached.append(f"region {region.id} not cached: an executor failed to compile it")
            elif key is not None and race is None:
                _store(self.artifacts, key, fn, source, region, self.by_name[region.executor], self.uncached)
        self.unfinished.clear()

    def _load_or_compile(self, source, region, ex_name, structure, why_no_key) -> Callable:
        artifacts, fn, key = self.artifacts, None, None
        if artifacts is not None and structure:
            key = region_key(structure, self.order, *(["autotune"] if self.autotune else []))
        elif artifacts is not None:
            self.uncached.append(f"region {region.id} not cached: no key ({why_no_key})")
        if key is not None:
            fn = _load_cached(artifacts.get(key), source, structure, region, self.by_name, self.uncached)
            if fn is not None:
                self.loaded.add(region.id)
        if fn is None:
            fn, failed = _compile_with_fallback(source, region, self.by_name[ex_name], self.order, self.fallback,
                                                finish=False)
            race = self._race(fn, source, region, None if failed else key) if self.autotune else None
            fn = race or fn  # a race is stored once its first call has chosen
            self.unfinished.append((fn, source, region, structure, key, failed))
        if island := next((n.meta["island"] for n in source.graph.nodes if "island" in n.meta), None):
            region.fallback_reason = "; ".join(filter(None, [island, region.fallback_reason]))
        return fn

    def _race(self, fn, source, region: Region, key: Optional[str]) -> Optional[Race]:
        """`fn` (by `region.executor`) racing the executors listed after it that take the whole region."""
        names = [e.name for e in self.listed]  # those before region.executor declined it already
        if region.executor not in names or why_not_raced(source):
            return None
        if not (others := [e for e in self.listed[names.index(region.executor) + 1:] if _claims_all(e, source)]):
            return None
        start, example_inputs = time.perf_counter(), _example_inputs(source)
        candidates = [(self.by_name[region.executor], fn)]
        for ex in others:
            try:
                candidates.append((ex, _compile_isolated(ex, source, example_inputs)))
            except Exception as e:  # declined or failed: not a candidate (the region runs as listed)
                log.info("region %d: autotune: %s did not compile it (%s: %s)", region.id, ex.name,
                         type(e).__name__, str(e).strip()[:200])
        self.autotune_seconds += time.perf_counter() - start
        if len(candidates) < 2:
            return None

        def decided(name: str, times: dict, seconds: float) -> None:
            if race.key is not None and times:  # a choice made without measuring (in a capture) is not kept
                self.artifacts.pop(race.key, None)
                _store(self.artifacts, race.key, race.chosen, source, region, self.by_name[name], self.uncached)
            self.autotune(seconds)
        race = Race(candidates, region, source, decided, ResultCheck(source, region, None).problem)
        race.key = key
        return race


def _load_cached(artifact: Optional[RegionArtifact], source, structure: str, region: Region, by_name,
                 notes) -> Optional[Callable]:
    """The region rebuilt from its artifact if that loads and was compiled from this graph (`structure`), else None."""
    if artifact is None or artifact.executor not in by_name:
        return None
    start = time.perf_counter()
    if artifact.structure != structure:  # another region's code: never run it here
        warnings.warn(f"pipeline cache: region {region.id}: the cached {artifact.executor} artifact was "
                      f"compiled from another region graph; not loaded, compiling it", PipelineWarning)
        notes.append(f"region {region.id}: cached artifact belongs to another region graph; compiled")
        return None
    example_inputs = _example_inputs(source)
    try:
        with _isolated(example_inputs):
            fn = _code_made(by_name[artifact.executor].load_region(artifact.data, source, example_inputs))
            by_name[artifact.executor].finish_region(fn)
    except Exception as e:  # a stale or foreign artifact: compile the region instead
        notes.append(f"region {region.id}: cached {artifact.executor} artifact did not load "
                     f"({type(e).__name__}: {str(e).strip()[:200]}); compiled")
        return None
    region.compile_seconds = time.perf_counter() - start
    region.executor, region.race, region.fallback_reason = artifact.executor, artifact.race, artifact.fallback_reason
    return fn


def _store(artifacts: dict, key: str, fn, source, region: Region, ex: Executor, notes) -> None:
    if (reason := ex.artifact_unsupported_reason(source, _example_inputs(source))) is None:
        try:
            artifacts[key] = RegionArtifact(ex.name, ex.save_region(fn), region.fallback_reason,
                                            structure_key(source), region.race)
            return
        except Exception as e:  # not storable: the region still runs, it is compiled next time
            reason = f"{ex.name} could not save it: {type(e).__name__}: {str(e).strip()[:200]}"
    notes.append(f"region {region.id} not cached: {reason}")


def _replace_wrong_result(problem: str, *, source, region: Region, structure, order, fallback,
                          replaced: dict, on_fallback) -> Callable:
    """The region compiled by the executors after the wrong one (`problem`); identical regions reuse it, unwarned."""
    wrong = next(e for e in order if e.name == region.executor)
    key = (wrong.name, structure) if structure else None
    if key in replaced:
        fn, first = replaced[key]
        region.executor, region.fallback_reason = first.executor, first.fallback_reason
        return fn
    later = [e for e in order[order.index(wrong) + 1:] if _claims_all(e, source)]
    if wrong.name == fallback.name:
        raise RuntimeError(f"{problem}; no other executor can run region {region.id}")
    fn, _ = _compile_with_fallback(source, region, (later or [fallback])[0], order, fallback)
    region.fallback_reason = "; ".join(filter(None, [problem, region.fallback_reason]))
    if key is not None:
        replaced[key] = (fn, region)
    on_fallback(f"region {region.id} ({region.graph_id} {region.stage}) runs on {region.executor}: {problem}")
    return fn


def _warn(message: str) -> None:
    warnings.warn(f"pipeline: {message}", PipelineFallbackWarning, stacklevel=3)


def _compile_with_fallback(source, region, first: Executor, order, fallback, finish=True) -> tuple[Callable, bool]:
    """The region compiled by the first candidate taking it, and whether any failed (not declined: raised an error)."""
    check_symbols_bound(source, f"region {region.id} ({region.stage}, for {first.name})")  # else a NameError when run
    example_inputs = _example_inputs(source)
    candidates = [first] + [e for e in order[order.index(first) + 1:] if e is not first and _claims_all(e, source)]
    if all(c.name != fallback.name for c in candidates):
        candidates.append(fallback)
    reasons, failed = [], False
    for ex in candidates:
        start = time.perf_counter()
        try:
            fn = _compile_isolated(ex, source, example_inputs)
            if finish:
                ex.finish_region(fn)
        except RegionDeclined as e:
            reasons.append(f"{ex.name} declined: {e}")
            continue
        except Exception as e:  # a region an executor cannot compile runs on the next one
            why = f"{type(e).__name__}: {str(e).strip()[:300]}"
        else:
            if callable(fn):
                region.compile_seconds = time.perf_counter() - start
                region.executor, region.fallback_reason = ex.name, "; ".join(reasons) or None
                return fn, failed
            why = f"compile_region returned {type(fn).__name__}, not a callable"
        failed = True
        reasons.append(f"{ex.name} failed to compile: {why}")
    raise RuntimeError(f"region {region.id}: no executor could compile it: {'; '.join(reasons)}")


def _compile_isolated(ex: Executor, source: fx.GraphModule, example_inputs):
    with _isolated(example_inputs):
        return _code_made(ex.compile_region(source, example_inputs))


def _code_made(fn):
    """`fn`, or if it is a lazy region module's stub (`partition`), the code it stands for, made now."""
    if getattr(fn, "__func__", None) is _LazyGraphModule._lazy_forward:
        fn.__self__.real_recompile()
        return fn.__self__.forward
    return fn


def _isolated(example_inputs):
    """A fresh tracing context: an executor's compile (or load) cannot disturb the AOTAutograd compilation it is in."""
    from torch._guards import TracingContext, detect_fake_mode, tracing
    fake_mode = detect_fake_mode(example_inputs)
    return tracing(TracingContext(fake_mode)) if fake_mode is not None else contextlib.nullcontext()


def _example_inputs(source: fx.GraphModule) -> list:
    """The fake values of a region's inputs: what its executor compiles (or loads) against."""
    return [node_value(n) for n in source.graph.nodes if n.op == "placeholder"]


def _claims_all(ex: Executor, gm: fx.GraphModule) -> bool:
    return all(ex.claims(n) for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)


def _describe(source: fx.GraphModule, stage: str, ex_name: str, graph_id: str, order: Sequence[Executor]) -> Region:
    nodes = list(source.graph.nodes)
    ops = [op_name(n.target) for n in nodes if n.op == "call_function" and n.target is not operator.getitem]
    ins = [describe_value(node_value(n)) for n in nodes if n.op == "placeholder"]
    outs = [describe_value(node_value(a)) if isinstance(a, fx.Node) else repr(a) for a in nodes[-1].args[0]]
    flops = [gemm_flops(n, order) for n in nodes if n.op == "call_function"]  # executors' hooks count their own ops
    return Region(id=0, stage=stage, executor=ex_name, ops=ops, input_shapes=ins,  # id: set by the caller
                  output_shapes=outs, graph_id=graph_id, gemm_flops=sum(f for f, _ in flops),
                  fp8_gemm_flops=sum(f for f, fp8 in flops if fp8))


def gemm_flops(node: fx.Node, executors: Sequence[Executor] = ()) -> tuple[int, bool]:
    """(matmul FLOPs of `node`, whether in fp8), (0, False) for other ops: aten's here, others by executors' `flops`."""
    for ex in executors:
        if (counted := ex.flops(node)) is not None:
            return counted
    shapes = [tuple(node_value(a).shape) if isinstance(a, fx.Node) and isinstance(node_value(a), torch.Tensor)
              else None for a in node.args]
    with contextlib.suppress(TypeError, IndexError):  # symbolic sizes: not counted
        if node.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            a, b = shapes[-2], shapes[-1]
            return 2 * a[0] * a[1] * b[1], False
        if node.target is torch.ops.aten.bmm.default:
            a, b = shapes
            return 2 * a[0] * a[1] * a[2] * b[2], False
    return 0, False


def unbuilt(executed: fx.GraphModule) -> fx.GraphModule:
    """An execution trace's module before its regions were built (`dispatch(partitioned=...)`); twins share a graph."""
    root, sources = {}, {}  # what the graph's call_module and get_attr nodes name
    for node in executed.graph.nodes:
        if node.op == "call_module":
            compiled = executed.get_submodule(node.target)
            sources[compiled.region.id] = root[node.target] = sources.get(compiled.region.compiled_as, compiled.source)
        elif node.op == "get_attr":  # a constant the stage reads outside its regions
            root[node.target] = operator.attrgetter(node.target)(executed)
    graph = fx.Graph()
    graph.output(graph.graph_copy(executed.graph, {})).meta = dict(executed.graph.output_node().meta)
    return fx.GraphModule(root, graph)
