"""Executors chosen by measured time (`autotune=True`; docs/executors.md): a region several listed executors take whole
is compiled by each (`Race`), timed at its first call (median of `RUNS`, GPU time on a GPU); ties: the first listed."""

import statistics
import time
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from ir import Region
from ir.torch_ops import writes_into

from .base import Executor
from .graph_utils import donated_inputs

NOISE = 0.05  # a listed-earlier candidate within 5% of the fastest is kept: timing noise, not a win
MAX_TIE = 0.2  # however noisy the fastest's runs, a candidate 20% slower is slower
RUNS = 5  # after one warm-up
GPU_CYCLES_PER_MS = 2e6  # a GPU's clock, near enough: a sleep found too short is made longer


def why_not_raced(gm: fx.GraphModule) -> Optional[str]:
    """None when running the region more than once at its first call changes nothing."""
    written = [n.name for n in gm.graph.nodes if writes_into(n)]
    return f"it writes into its inputs ({', '.join(written[:3])})" if written else None


class Race:
    """One kind of region's compiled candidates until its first call picks one, which `decided(...)` is told."""

    def __init__(self, candidates: Sequence[tuple[Executor, Callable]], region: Region, gm: fx.GraphModule,
                 decided: Callable[[str, dict, float], None], problem: Callable[[object], Optional[str]]):
        self.candidates = dict((ex.name, fn) for ex, fn in candidates)
        self.regions = [region]  # the first region and its identical twins: all take the choice
        self.donated = donated_inputs(gm)
        self.decided, self.problem = decided, problem  # problem(out): what is wrong with a result, or None
        self.chosen: Optional[Callable] = None
        self.key: Optional[str] = None  # the artifact-cache key its choice is stored under (set by dispatch)

    def __call__(self, *args):
        return self.boxed(list(args))

    def boxed(self, args: list):
        if self.chosen is None:
            self._choose(args)
        if (run := getattr(self.chosen, "boxed", None)) is not None:
            return run(args)
        held = tuple(args)
        args.clear()
        return self.chosen(*held)

    def _choose(self, args: list) -> None:
        start = time.perf_counter()
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            times = {}  # never measured inside a CUDA-graph capture: the first listed runs
        else:  # every GPU's RNG is restored: a region may draw on one without reading from it
            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            on_gpu = cuda and any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)  # else wall time
            with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if cuda else []):
                times, spread, failed = {}, {}, []
                for name, fn in self.candidates.items():
                    try:
                        times[name], spread[name] = _median_ms(fn, args, self.donated, on_gpu, self.problem)
                    except Exception as e:  # a candidate failing on these inputs, or wrong, is not chosen
                        failed.append(f"{name} failed when timed: {type(e).__name__}: {str(e).strip()[:200]}")
            if not times:
                raise RuntimeError(f"region {self.regions[0].id}: autotune: {'; '.join(failed)}")
            for r in self.regions:
                r.fallback_reason = "; ".join(filter(None, [r.fallback_reason, *failed])) or None
        best = min(times, key=times.get, default=None)
        name = next((n for n, ms in times.items() if ms - times[best] <= min(
            max(NOISE * times[best], 2 * (spread[n] + spread[best])), MAX_TIE * times[best])),
            next(iter(self.candidates)))
        self.chosen = self.candidates[name]
        self.candidates = {name: self.chosen}  # the others' compiled code is not kept
        for r in self.regions:
            r.executor, r.race = name, times
        self.decided(name, times, time.perf_counter() - start)


def _median_ms(fn: Callable, args: list, donated: list[int], cuda: bool, problem) -> tuple[float, float]:
    """Median ms of `fn` on `args` and their median absolute deviation (donated inputs copied per run)."""
    run = getattr(fn, "boxed", None) or (lambda a: fn(*a))

    def fresh() -> list:
        return [x.clone() if i in donated else x for i, x in enumerate(args)]

    a = fresh()  # the warm-up, its result checked
    t0 = time.perf_counter()
    if (wrong := problem(run(a))) is not None:
        raise ValueError(wrong)
    host_ms = (time.perf_counter() - t0) * 1e3  # launching, and any first-call work
    times, cycles, longer = [], int(GPU_CYCLES_PER_MS * min(max(2 * host_ms, 0.2), 50)), 3
    while len(times) < RUNS:
        a = fresh()
        if cuda:  # the GPU sleeps while the host queues the launches: the events time the kernels
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(cycles)
            begin.record()
        t0 = time.perf_counter()
        run(a)
        host = (time.perf_counter() - t0) * 1e3
        if cuda:
            woke_early = begin.query()  # the GPU was done sleeping before the host was done launching
            end.record()
            end.synchronize()
            if woke_early and longer:  # it timed the launching too: again, sleeping 4x longer (50 ms, 3 times at most)
                cycles, longer = min(cycles * 4, int(50 * GPU_CYCLES_PER_MS)), longer - 1
                continue
        times.append(begin.elapsed_time(end) if cuda else host)
    median = statistics.median(times)
    return median, statistics.median(abs(t - median) for t in times)
