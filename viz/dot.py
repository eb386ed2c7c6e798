"""A `RegionGraph` as Graphviz's DOT text: a cluster per graph and stage, boxes filled by executor,
wires as thick as the bytes they carry, and a legend (the graph's label, so every node is a region)."""
from __future__ import annotations

import html
from collections import Counter

from .colors import executor_colors
from .region_graph import Box, RegionGraph, Wire

FALLBACK_BORDER = "#c0392b"   # a region an executor failed to compile (or ran wrongly): it runs on the next one
SAVED_COLOR = "#7b5ea7"       # wires of activations the forward keeps for the backward


def to_dot(graph: RegionGraph) -> str:
    colors = executor_colors(b.region.executor for b in graph.boxes.values())
    lines = ["digraph regions {",
             '  graph [fontname="Helvetica" fontsize=10 labelloc=b labeljust=l newrank=true nodesep=0.3 '
             f"label={_legend(colors)}];",
             '  node [shape=box style="rounded,filled" fontname="Helvetica" fontsize=10 color="#555555"];',
             '  edge [fontname="Helvetica" fontsize=8 color="#555555" fontcolor="#333333"];']
    clusters: dict[tuple[str, str], list[Box]] = {}
    for box in graph.boxes.values():
        clusters.setdefault((box.region.graph_id, box.region.stage), []).append(box)
    for k, ((graph_id, stage), boxes) in enumerate(clusters.items()):
        lines.append(f'  subgraph cluster_{k} {{ label="{_esc(f"{graph_id} {stage}".strip())}"; '
                     'style="rounded,dashed"; color="#999999"; fontcolor="#555555";')
        lines += [f"    {_node(box, colors[box.region.executor])}" for box in boxes]
        lines.append("  }")
    biggest = max((w.nbytes for w in graph.wires), default=0) or 1
    lines += [f"  {_edge(w, biggest)}" for w in graph.wires]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _node(box: Box, fill: str) -> str:
    r = box.region
    reason = r.fallback_reason or ""
    fell_back = "failed to compile" in reason or "wrong result" in reason
    label = [f"region {r.id} · {r.executor}" + (f"  ×{box.count}" if box.count > 1 else ""),
             f"{r.op_count} op{'s' if r.op_count != 1 else ''}: {_top_ops(r.ops)}" if r.ops else "no ops"]
    if box.ms is not None:
        label.append(f"{box.ms:.3f} ms" + (f" (all {box.count})" if box.count > 1 else ""))
    if fell_back:
        label.append("fallback")
    members = ", ".join(map(str, box.members))
    tooltip = (f"{'regions ' + members if box.count > 1 else 'region ' + members} ({r.graph_id} {r.stage}, "
               f"{r.executor}): {_top_ops(r.ops, limit=None)}" + (f"; {reason}" if reason else ""))
    race = getattr(r, "race", None)  # autotune=True: each candidate executor's time
    if race:
        tooltip += "; autotuned: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in race.items())
    extra = f' color="{FALLBACK_BORDER}" penwidth=2' if fell_back else ""
    return (f'r{r.id} [label="{_esc(chr(10).join(label))}" fillcolor="{fill}" '
            f'tooltip="{_esc(tooltip)}"{extra}];')


def _edge(wire: Wire, biggest: int) -> str:
    shapes = Counter(d for d, _ in wire.tensors)
    shown = 1 if wire.saved else 3  # saved wires start side by side: short labels, the rest in the tooltip
    label = [f"{d} ×{n}" if n > 1 else d for d, n in shapes.most_common(shown)]
    if len(shapes) > shown:
        label.append(f"+{len(shapes) - shown} more shape{'s' if len(shapes) - shown > 1 else ''}")
    label.append(("saved " if wire.saved else "") + _size(wire.nbytes)
                 + (f", {len(wire.readers)} readers" if len(wire.readers) > 1 else ""))
    width = 0.8 + 5.2 * (wire.nbytes / biggest) ** 0.5
    tooltip = ", ".join(f"{d} ×{n}" if n > 1 else d for d, n in shapes.items())
    style = ""
    if wire.saved:  # drawn to the first backward box that reads them; the tooltip names every reader
        tooltip += "; read by region" + ("s " if len(wire.readers) > 1 else " ") + ", ".join(map(str, wire.readers))
        style = f' style=dashed color="{SAVED_COLOR}" fontcolor="{SAVED_COLOR}" constraint=false'
    return (f'r{wire.src} -> r{wire.dst} [label="{_esc(chr(10).join(label))}" penwidth={width:.2f} '
            f'tooltip="{_esc(tooltip)}"{style}];')


def _legend(colors: dict[str, str]) -> str:
    """An HTML-like table: a cell per executor, filled as its boxes are, and what the marks mean."""
    cells = "".join(f'<TD BGCOLOR="{c}" ID="legend_{html.escape(name)}" STYLE="rounded"> {html.escape(name)} </TD>'
                    for name, c in colors.items())
    note = ("×N: N identical regions run one compiled code<BR ALIGN=\"LEFT\"/>edge width: bytes passed per call; "
            "dashed: saved for the backward<BR ALIGN=\"LEFT\"/>red border: fallback<BR ALIGN=\"LEFT\"/>")
    return (f'<<TABLE BORDER="0" CELLSPACING="4" CELLPADDING="3"><TR><TD>executor:</TD>{cells}'
            f'<TD><FONT POINT-SIZE="8">{note}</FONT></TD></TR></TABLE>>')


def _top_ops(ops: list[str], limit: int | None = 3) -> str:
    """The most frequent ops first: `mul×28, add×13, view×9, …`."""
    common = Counter(ops).most_common()
    text = ", ".join(f"{op}×{n}" if n > 1 else op for op, n in common[:limit])
    return text + (", …" if limit is not None and len(common) > limit else "")


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def _esc(text: str) -> str:
    """A DOT double-quoted string's content; newlines become centred line breaks."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
