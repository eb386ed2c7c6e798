"""What the pipeline remembers about each compiled graph: every stage's trace, the regions, the fallbacks and their
reasons, and where the time went. `pipeline.regions`, `last_traces` and `compile_stats` read these records."""

import dataclasses
import os
import re
from collections import defaultdict
from typing import Optional

from ir import Region, Trace, python_source, verify
from ir.typecheck import check_types


@dataclasses.dataclass
class GraphRecord:
    """One graph Dynamo captured and the pipeline compiled."""
    graph_id: str                    # g0, g1, ... in the order they were compiled
    compile_id: str                  # Dynamo's frame/recompile id, e.g. "0/1"
    generation: int                  # which call of the compiled model compiled it
    traces: list[Trace] = dataclasses.field(default_factory=list)
    regions: list[Region] = dataclasses.field(default_factory=list)
    fallbacks: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    decomposed: list[str] = dataclasses.field(default_factory=list)
    eager_fallback: Optional[str] = None  # why the whole graph runs in eager, if it does
    recompile_reason: Optional[str] = None  # the guard that failed, when this graph is a recompilation
    cache: str = ""                  # compiled-artifact cache: "hit", "miss" or "off: <why>"
    cache_notes: list[str] = dataclasses.field(default_factory=list)  # regions not cached, and why
    seconds: dict[str, float] = dataclasses.field(default_factory=lambda: defaultdict(float))
    cuda_graphs: dict[str, str] = dataclasses.field(default_factory=dict)  # stage -> "on" | "off: why"

    def add_trace(self, trace: Trace) -> Trace:
        self.traces.append(trace)
        if os.environ.get("PIPELINE_DEBUG", "") not in ("", "0"):  # every node re-derived, not only changed ones
            verify(trace)
            if trace.ops() and not any(n.op == "call_module" for n in trace.graph.nodes):
                check_types(trace)
            dump(trace, len(self.traces))
        return trace


def dump(trace: Trace, index: int) -> str:
    """Writes the trace where `PIPELINE_DEBUG=1` keeps them: <`PIPELINE_DUMP_DIR` or ./pipeline_dump>/<pid>."""
    root = os.environ.get("PIPELINE_DUMP_DIR") or os.path.join(os.getcwd(), "pipeline_dump")
    os.makedirs(folder := os.path.join(root, str(os.getpid())), exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", trace.name)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", trace.provenance[-1].name if trace.provenance else "trace").strip("_")
    path = os.path.join(folder, f"{safe}.{index:02d}.{slug}.py")
    with open(path, "w") as f:
        f.write(python_source(trace))
    return path
