"""Inspection: which executor ran what (`regions`), each stage's trace (`last_traces`), `compile_stats`, `explain`."""

import dataclasses
from collections import Counter, defaultdict
from typing import Callable

import torch

from ir import Trace


def _state(cm):
    if (state := getattr(cm, "_state", None)) is None:
        raise TypeError(f"expected a model or function returned by pipeline.jit, got {type(cm).__name__}")
    return state


class RegionTable(list):
    """A list of `Region`s that prints as a table."""

    def __str__(self) -> str:
        if not self:
            return "(no regions: the model has not been called yet, or it ran entirely in eager)"
        rows = [("id", "graph", "stage", "executor", "#ops", "ops", "inputs", "outputs")]
        rows += [(str(r.id), r.graph_id, r.stage, r.executor + _fallback_mark(r.fallback_reason), str(r.op_count),
                  _summarize(r.ops), _clip(", ".join(r.input_shapes)), _clip(", ".join(r.output_shapes))) for r in self]
        # a region compiled as an earlier identical one shares its reason: say it once
        notes = [f"region {r.id}: {r.fallback_reason}" for r in self if r.fallback_reason and r.compiled_as is None]
        notes += [_race_note(r, sum(t.compiled_as == r.id for t in self)) for r in self if r.race and r.compiled_as is None]
        if twins := sum(r.compiled_as is not None for r in self):
            notes.append(f"{twins} of {len(self)} regions run the code compiled for an identical earlier "
                         f"region (Region.compiled_as)")
        return "\n".join(format_table(rows) + notes)

    __repr__ = __str__

    def fp8_gemm_flop_share(self) -> float | None:
        """The share of the model's matmul FLOPs that ran in fp8 (None when there are none)."""
        total = sum(r.gemm_flops for r in self)
        return sum(r.fp8_gemm_flops for r in self) / total if total else None

    def by_executor(self) -> dict[str, int]:
        return {e: sum(r.op_count for r in self if r.executor == e) for e in dict.fromkeys(r.executor for r in self)}


def regions(cm) -> RegionTable:
    """Every region of every compiled graph: id, graph, stage, executor, ops, input/output shapes."""
    return RegionTable(r for rec in _state(cm).history.records for r in rec.regions)


def last_traces(cm) -> list[Trace]:
    """Each stage's traces of the latest compiling call's graphs, in pipeline order (captured first, execution last)."""
    if not (records := _state(cm).history.records):
        raise RuntimeError("nothing compiled yet: call the jitted model first")
    latest = max(r.generation for r in records)
    return [t for rec in records if rec.generation == latest for t in rec.traces]


def _race_note(r, twins: int) -> str:
    """"region 3 (and 15 identical) autotuned: inductor 0.120 ms (chosen), nvfuser 0.180 ms"."""
    times = ", ".join(f"{name} {ms:.3f} ms" + (" (chosen)" if name == r.executor else "") for name, ms in r.race.items())
    return f"region {r.id}{f' (and {twins} identical)' if twins else ''} autotuned: {times or 'not timed'}"


def _fallback_mark(reason) -> str:
    """" (declined)" when earlier executors declined the region, " (fallback)" when one of them failed, else ""."""
    if not reason:
        return ""
    return " (fallback)" if "failed to compile" in reason or "wrong result" in reason else " (declined)"


@dataclasses.dataclass
class CompileStats:
    graphs: int
    graph_breaks: list[str]
    recompilations: int
    recompile_reasons: list[str]              # the failed guard of each recompilation
    seconds: dict[str, float]                 # per stage, summed over graphs
    eager_fallbacks: dict[str, str]           # graph id -> why it runs in eager
    op_fallbacks: list[tuple[str, str, str]]  # (graph id, op, why it runs on torch)
    region_fallbacks: list[tuple[int, str]]   # (region id, why its executor did not compile it)
    decomposed: dict[str, int]                # op -> how many times it was decomposed
    cache: dict[str, str] = dataclasses.field(default_factory=dict)  # graph id -> hit | miss | off: why
    cache_notes: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (graph id, note)
    cuda_graphs: dict[str, str] = dataclasses.field(default_factory=dict)  # "g0 forward" -> on | off: why
    fallbacks: list[str] = dataclasses.field(default_factory=list)  # every loud fallback (fallbacks.py)

    @property
    def cache_hits(self) -> int:
        return sum(v == "hit" for v in self.cache.values())

    @property
    def cache_misses(self) -> int:
        return sum(v == "miss" for v in self.cache.values())

    def __str__(self) -> str:
        lines = [f"graphs: {self.graphs}   graph breaks: {len(self.graph_breaks)}   "
                 f"recompilations: {self.recompilations}   cache hits: {self.cache_hits}   "
                 f"misses: {self.cache_misses}   fallbacks: {len(self.fallbacks)}",
                 "seconds: " + ", ".join(f"{k} {v:.3f}" for k, v in self.seconds.items())]
        lines += [f"graph break: {r}" for r in self.graph_breaks]
        lines += [f"recompiled: {r}" for r in self.recompile_reasons]
        lines += [f"fallback: {why}" for why in self.fallbacks]
        lines += [f"{g}: {op} runs on torch: {why}" for g, op, why in self.op_fallbacks]
        lines += [f"region {i}: {why}" for i, why in self.region_fallbacks]
        lines += [f"{g}: cache {status}" for g, status in self.cache.items() if status.startswith("off")]
        lines += [f"{g}: cache: {note}" for g, note in self.cache_notes]
        lines += [f"{g}: CUDA graph {status}" for g, status in self.cuda_graphs.items()]
        lines += ["decomposed: " + ", ".join(f"{k}×{v}" for k, v in self.decomposed.items())] if self.decomposed else []
        return "\n".join(lines)


def compile_stats(cm) -> CompileStats:
    history = _state(cm).history
    seconds: dict[str, float] = defaultdict(float, capture=history.capture_seconds)
    for k, v in ((k, v) for rec in history.records for k, v in rec.seconds.items() if k != "total"):
        seconds[k] += v
    return CompileStats(
        graphs=len(history.records), graph_breaks=list(history.graph_breaks), recompilations=history.recompiles,
        seconds=dict(seconds), recompile_reasons=[r.recompile_reason for r in history.records if r.recompile_reason],
        eager_fallbacks={r.graph_id: r.eager_fallback for r in history.records if r.eager_fallback},
        op_fallbacks=[(r.graph_id, op, why) for r in history.records for op, why in r.fallbacks],
        region_fallbacks=[(g.id, g.fallback_reason) for r in history.records for g in r.regions if g.fallback_reason],
        decomposed=dict(Counter(op for r in history.records for op in r.decomposed)),
        cache={r.graph_id: r.cache for r in history.records if r.cache}, fallbacks=list(history.fallbacks),
        cache_notes=[(r.graph_id, n) for r in history.records for n in r.cache_notes],
        cuda_graphs={f"{r.graph_id} {stage}": v for r in history.records for stage, v in r.cuda_graphs.items()})


@dataclasses.dataclass
class GraphBreak:
    reason: str
    where: str   # file:line of the user's code


@dataclasses.dataclass
class Explanation:
    graphs: int
    graph_breaks: list[GraphBreak]
    ops_per_graph: list[int]

    def __str__(self) -> str:
        head = f"{self.graphs} graph(s), {len(self.graph_breaks)} graph break(s); ops per graph: {self.ops_per_graph}"
        return "\n".join([head] + [f"  break at {b.where}: {b.reason}" for b in self.graph_breaks])


def explain(fn_or_module: Callable, *args, **kwargs) -> Explanation:
    """Captures `fn_or_module(*args)` without compiling and reports graphs and graph breaks."""
    if not callable(fn_or_module):
        raise TypeError(f"explain needs a module or function, got {type(fn_or_module).__name__}")
    out = torch._dynamo.explain(fn_or_module)(*args, **kwargs)
    breaks = [GraphBreak(reason=b.reason.splitlines()[0], where=f"{b.user_stack[-1].filename}:{b.user_stack[-1].lineno}"
                         if b.user_stack else "unknown") for b in out.break_reasons]
    return Explanation(graphs=out.graph_count, graph_breaks=breaks,
                       ops_per_graph=[sum(n.op.startswith("call_") for n in g.graph.nodes) for g in out.graphs])


def format_table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _summarize(ops: list[str], limit: int = 60) -> str:
    return _clip(", ".join(f"{k}×{v}" if v > 1 else k for k, v in Counter(ops).items()), limit)


def _clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
