"""`CompiledRegion`: a region of an execution trace as it runs, its executor's code behind its first call's checks."""

from typing import Callable, Optional

import torch
import torch.fx as fx

from ir import Region

from .result_check import ResultCheck


class CompiledRegion(torch.nn.Module):
    """One region as it runs: the executor's callable, its first call checked (every call under `PIPELINE_DEBUG=1`): if
    wrong, the next executor claiming it runs it (`replace`). Under `pipeline.profile`, calls are profiler ranges."""

    profiling = False

    def __init__(self, fn: Callable, region: Region, source: fx.GraphModule,
                 replace: Optional[Callable[[str], Callable]] = None):
        super().__init__()
        self.fn, self.region, self.source = fn, region, source  # source: the region's ATen graph, for inspection
        self.check = ResultCheck(source, region, replace)
        self.forward = self._checked_forward  # instance attributes: dropped after the first call
        self.call_boxed = self._checked_call_boxed

    def _checked_forward(self, *args):
        return self._checked(list(args), boxed=False)

    def _checked_call_boxed(self, args: list):
        return self._checked(args, boxed=True)

    def _checked(self, args: list, boxed: bool):
        held = self.check.hold(args)  # the inputs, to run the region again if its result is wrong
        out = CompiledRegion.call_boxed(self, args) if boxed else CompiledRegion.forward(self, *args)
        while (problem := self.check.problem(out)) is not None:
            self.fn = self.check.replacement(problem)
            if held is None:
                raise RuntimeError(f"{problem}; this call cannot run again (the region's inputs were donated "
                                   f"to it): the next call runs on {self.region.executor}")
            out = CompiledRegion.forward(self, *held)
        if not self.check.every_call:
            del self.forward, self.call_boxed
        return out

    @property
    def label(self) -> str:  # a named range in the profiler's timeline
        return f"region{self.region.id}:{self.region.executor}"

    def forward(self, *args):
        if CompiledRegion.profiling:
            with torch.profiler.record_function(self.label):
                return self.fn(*args)
        return self.fn(*args)

    def call_boxed(self, args: list):
        """Runs the region on a list it empties: through `fn.boxed(list)` (Inductor's), inputs freed after last use."""
        if (run := getattr(self.fn, "boxed", None)) is None:
            held = tuple(args)
            args.clear()
            return CompiledRegion.forward(self, *held)
        if CompiledRegion.profiling:
            with torch.profiler.record_function(self.label):
                return run(args)
        return run(args)

    def extra_repr(self) -> str:
        return f"{self.region.executor}, {self.region.op_count} ops"
