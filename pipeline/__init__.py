"""The pipeline: `jit` and the inspection functions.

    cm = pipeline.jit(model, executors=["inductor"])
    cm(x)
    print(pipeline.regions(cm))        # which executor ran which ops
    print(pipeline.last_traces(cm)[-1])  # the execution trace, as Python
"""
from .checkpoint import load, load_full, save
from .compiler import PassError
from .inspect import CompileStats, Explanation, RegionTable, compile_stats, explain, last_traces, regions
from .default_passes import default_passes, without
from .fallbacks import PipelineFallbackError
from ir import PipelineFallbackWarning, PipelineWarning
from .jit import GraphBreakError, JittedFunction, JittedModule, jit
from .profile import profile


def draw(cm, path, **options):
    """A picture of cm's regions by executor, to .svg, .dot or .html: `viz.draw.draw`, imported on use."""
    from viz.draw import draw as draw_regions
    return draw_regions(cm, path, **options)

__all__ = ["jit", "default_passes", "without", "profile", "draw", "save", "load", "load_full", "regions", "last_traces", "compile_stats", "explain", "GraphBreakError", "PassError",
           "PipelineFallbackError", "PipelineFallbackWarning", "PipelineWarning",
           "JittedModule", "JittedFunction", "RegionTable", "CompileStats", "Explanation"]
