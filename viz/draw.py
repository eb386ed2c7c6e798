"""`pipeline.draw(cm, path)`: a picture of the regions a jitted model runs, coloured by executor.

    cm(x)                                          # compile first
    pipeline.draw(cm, "regions.svg")               # .svg, .dot (Graphviz's text) or .html
    pipeline.draw(cm, "regions.svg", profile=pipeline.profile(cm, x))   # with each region's time

One box per region (identical regions, compiled once, as one box with their count, `×16`), grouped by
graph and stage (forward, backward, inference), labelled with its ops; arrows are the tensors passed
between regions (shapes, dtypes, bytes; the most bytes thickest), dashed from the forward to the
backward for the activations it saves. Rendered by Graphviz's `dot` program: without it the `.dot` is
written next to `path` and `GraphvizMissing` says how to render it.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Iterable, Optional

from .dot import to_dot
from .region_graph import region_graph

FORMATS = (".svg", ".dot", ".html")


class GraphvizMissing(RuntimeError):
    """Graphviz's `dot` program is not installed: only the `.dot` file was written."""


def draw(cm, path, *, profile: Optional[Iterable] = None) -> Path:
    """Writes the picture of `cm` (a `pipeline.jit` result that has been called) to `path`, in the
    format its extension names (.svg, .dot, .html); returns the path. `profile`: the table
    `pipeline.profile(cm, ...)` returned, to label each region with its time."""
    path = Path(path)
    fmt = path.suffix.lower()
    if fmt not in FORMATS:
        raise ValueError(f"pipeline.draw: cannot write {path.name!r}: the extension must be one of "
                         f"{', '.join(FORMATS)}")
    text = to_dot(region_graph(cm, profile))
    if fmt == ".dot":
        path.write_text(text, encoding="utf-8")
        return path
    binary = shutil.which("dot")
    if binary is None:
        dot_path = path.with_suffix(".dot")
        dot_path.write_text(text, encoding="utf-8")
        raise GraphvizMissing(
            f"pipeline.draw: Graphviz's `dot` program is not on PATH, so {path} was not written; the graph is in "
            f"{dot_path}. Install Graphviz (apt-get install graphviz, brew install graphviz or conda install "
            f"graphviz) and render it with: dot -Tsvg {dot_path} -o {path.with_suffix('.svg')}")
    svg = render_svg(text, binary)
    path.write_text(svg if fmt == ".svg" else _html(svg, path.stem), encoding="utf-8")
    return path


def render_svg(dot_text: str, binary: str = "dot") -> str:
    done = subprocess.run([binary, "-Tsvg"], input=dot_text.encode(), capture_output=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"pipeline.draw: Graphviz failed (exit {done.returncode}): "
                           f"{done.stderr.decode(errors='replace').strip()[:500]}")
    return done.stdout.decode()


def _html(svg: str, title: str) -> str:
    """The SVG inline in a minimal page (without its XML prolog), so tooltips work in a browser."""
    body = svg[svg.index("<svg"):] if "<svg" in svg else svg
    title = re.sub(r"[<>&]", "", title)
    return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{title}</title></head>\n'
            f"<body>\n{body}</body></html>\n")
