"""`pipeline.profile(cm, *args)`: each region's time from the torch profiler (its kernels' device time on a GPU, else
host time); each region runs in a named range (`region3:inductor`), also in a `chrome_trace` timeline."""

import dataclasses
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile as torch_profile

from executors import CompiledRegion

from .inspect import _clip, _summarize, compile_stats, format_table, regions


@dataclasses.dataclass
class RegionTime:
    id: int
    stage: str
    executor: str
    ops: str
    calls: int
    ms: float


class ProfileTable(list):
    def __str__(self) -> str:
        rows = [("id", "stage", "executor", "calls", "ms", "ops")]
        rows += [(str(r.id), r.stage, r.executor, str(r.calls), f"{r.ms:.3f}", r.ops) for r in self]
        return "\n".join(format_table(rows) + [f"total in regions: {sum(r.ms for r in self):.3f} ms"])

    __repr__ = __str__


def profile(cm, *args, backward: bool = True, chrome_trace: Optional[str] = None, **kwargs) -> ProfileTable:
    """Profiles one `cm(*args, **kwargs)` (and its sum's backward, if `backward` and it needs grad): time per region."""
    cm(*args, **kwargs)  # compile first, so compilation is not profiled
    if recorded := [k for k, v in compile_stats(cm).cuda_graphs.items() if v == "on"]:
        raise ValueError(f"pipeline.profile times regions one by one, but this model replays CUDA graphs "
                         f"({', '.join(recorded)}): profile a pipeline.jit of it without cuda_graphs=True")
    use_cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
    CompiledRegion.profiling = True
    try:
        with torch_profile(activities=activities) as prof:
            out = cm(*args, **kwargs)
            if backward and isinstance(out, torch.Tensor) and out.requires_grad:
                out.float().sum().backward()
            if use_cuda:
                torch.cuda.synchronize()
    finally:
        CompiledRegion.profiling = False
    if chrome_trace:
        prof.export_chrome_trace(chrome_trace)
    by_label, result = {e.key: e for e in prof.key_averages()}, ProfileTable()
    for r in regions(cm):
        if (event := by_label.get(f"region{r.id}:{r.executor}")) is not None:
            ms = (getattr(event, "device_time_total", 0) or event.cpu_time_total) / 1e3
            result.append(RegionTime(r.id, r.stage, r.executor, _clip(_summarize(r.ops), 50), event.count, ms))
    return result
