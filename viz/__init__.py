"""Pictures of what `pipeline.jit` compiled. Outside the core (`ir`, `pipeline`, `executors`,
`transforms`): it only reads what the pipeline records, and Graphviz is optional.

    pipeline.draw(cm, "regions.svg")      # or .dot, .html; see viz/draw.py
"""
from .draw import GraphvizMissing, draw

__all__ = ["draw", "GraphvizMissing"]
