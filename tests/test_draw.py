"""pipeline.draw: a picture of the regions, one box per kind of region, coloured by executor.

The SVG checks need Graphviz's `dot` (apt-get install graphviz) and skip without it; the `.dot`
output, the message when `dot` is missing and the errors do not need it."""
import re
import shutil
import xml.etree.ElementTree as ET

import pytest
import torch

import pipeline
from helpers import Claiming
from viz import GraphvizMissing
from viz.region_graph import region_graph

needs_dot = pytest.mark.skipif(shutil.which("dot") is None,
                               reason="Graphviz's dot is not installed (apt-get install graphviz)")
SVG = "{http://www.w3.org/2000/svg}"


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.linear(x)) + x


def trained(layers=4, executors=None):
    """N identical layers, one training step: pointwise ops on `fuse`, the matmuls on `torch`."""
    model = torch.nn.Sequential(*[Block() for _ in range(layers)])
    cm = pipeline.jit(model, executors=executors or [Claiming("fuse", tag=torch.Tag.pointwise), "torch"])
    x = torch.randn(8, 16, requires_grad=True)
    cm(x).sum().backward()
    return cm, x


def svg_nodes(path):
    """{title: (fill, label text)} of every node of a Graphviz SVG."""
    nodes = {}
    for g in ET.parse(path).getroot().iter(f"{SVG}g"):
        if g.get("class") == "node":
            shape = next(e for e in g.iter() if e.tag in (f"{SVG}path", f"{SVG}polygon"))
            nodes[g.find(f"{SVG}title").text] = (shape.get("fill"), shape.get("stroke"),
                                                 " ".join(t.text or "" for t in g.iter(f"{SVG}text")))
    return nodes


def svg_edges(path):
    """{title "r1->r2": (stroke width, stroke-dasharray, label text)} of every edge."""
    edges = {}
    for g in ET.parse(path).getroot().iter(f"{SVG}g"):
        if g.get("class") == "edge":
            line = g.find(f".//{SVG}path")
            edges[g.find(f"{SVG}title").text] = (float(line.get("stroke-width", 1)), line.get("stroke-dasharray"),
                                                 " ".join(t.text or "" for t in g.iter(f"{SVG}text")))
    return edges


def svg_legend(path):
    """{executor: fill} from the legend: the graph's own filled cells, each followed by its name."""
    graph = next(g for g in ET.parse(path).getroot().iter(f"{SVG}g") if g.get("class") == "graph")
    legend, fill = {}, None
    for e in graph:
        if e.tag in (f"{SVG}path", f"{SVG}polygon"):
            fill = e.get("fill") if e.get("fill") not in ("white", "none") else None
        elif e.tag == f"{SVG}text" and fill is not None:
            legend[e.text.strip()] = fill
            fill = None
    return legend


@needs_dot
def test_one_node_per_kind_of_region_and_identical_layers_once_with_their_count(tmp_path):
    cm, _ = trained(layers=4)
    assert pipeline.draw(cm, tmp_path / "regions.svg") == tmp_path / "regions.svg"
    nodes = svg_nodes(tmp_path / "regions.svg")
    regions = pipeline.regions(cm)
    assert set(nodes) == {f"r{r.id}" for r in regions if r.compiled_as is None}
    for r in regions:  # every region is drawn: as its own node, or in the node of the one it reuses
        assert f"r{r.id if r.compiled_as is None else r.compiled_as}" in nodes
    count = {r.id: 1 + sum(t.compiled_as == r.id for t in regions) for r in regions if r.compiled_as is None}
    assert max(count.values()) == 4  # the pointwise region of each layer, forward
    for rid, n in count.items():
        label = nodes[f"r{rid}"][2]
        assert (f"×{n}" in label) == (n > 1), label
        assert re.search(rf"region {rid} · \w+ .*\d+ ops?:", label), label

    deeper, _ = trained(layers=8)  # twice the layers, the same picture (with other counts)
    pipeline.draw(deeper, tmp_path / "deeper.svg")
    assert len(svg_nodes(tmp_path / "deeper.svg")) == len(nodes)
    assert "×8" in " ".join(label for _, _, label in svg_nodes(tmp_path / "deeper.svg").values())


@needs_dot
def test_nodes_are_filled_by_executor_as_the_legend_says(tmp_path):
    cm, _ = trained()
    pipeline.draw(cm, tmp_path / "regions.svg")
    nodes, legend = svg_nodes(tmp_path / "regions.svg"), svg_legend(tmp_path / "regions.svg")
    fills = {}
    for r in pipeline.regions(cm):
        if r.compiled_as is None:
            fills.setdefault(r.executor, set()).add(nodes[f"r{r.id}"][0])
    assert set(fills) == {"fuse", "torch"} == set(legend)
    assert all(len(f) == 1 for f in fills.values()), fills  # one colour per executor
    assert fills["fuse"] != fills["torch"]
    assert {ex: f.pop() for ex, f in fills.items()} == legend


@needs_dot
def test_edges_carry_shape_dtype_and_bytes_the_most_bytes_thickest(tmp_path):
    cm, _ = trained()
    pipeline.draw(cm, tmp_path / "regions.svg")
    edges = svg_edges(tmp_path / "regions.svg")
    wires = region_graph(cm).wires
    assert {f"r{w.src}->r{w.dst}" for w in wires} == set(edges)
    for w in wires:
        label = edges[f"r{w.src}->r{w.dst}"][2]
        assert "f32[8, 16]" in label and re.search(r"\d+(\.\d)? (B|KiB)", label), label
    widths = {f"r{w.src}->r{w.dst}": w.nbytes for w in wires}
    thickest = max(edges, key=lambda t: edges[t][0])
    assert widths[thickest] == max(widths.values())
    assert edges[min(edges, key=lambda t: edges[t][0])][0] < edges[thickest][0]
    # the activations the forward saves: dashed, from a forward box into the backward
    stage = {f"r{r.id}": r.stage for r in pipeline.regions(cm)}
    saved = [t for t, (_, dash, label) in edges.items() if dash and "saved" in label]
    assert saved and all(stage[t.split("->")[0]] == "forward" and stage[t.split("->")[1]] == "backward"
                         for t in saved)


@needs_dot
def test_profiled_times_label_the_regions(tmp_path):
    cm, x = trained(layers=2)
    times = pipeline.profile(cm, x)
    pipeline.draw(cm, tmp_path / "regions.svg", profile=times)
    labels = [label for _, _, label in svg_nodes(tmp_path / "regions.svg").values()]
    assert labels and all(re.search(r"\d+\.\d{3} ms", label) for label in labels), labels


@needs_dot
@pytest.mark.allow_fallback
def test_a_region_that_fell_back_has_a_red_border(tmp_path):
    broken = Claiming("broken", tag=torch.Tag.pointwise, fail=True)
    with pytest.warns(pipeline.PipelineFallbackWarning):
        cm, _ = trained(layers=2, executors=[broken, "torch"])
    pipeline.draw(cm, tmp_path / "regions.svg")
    nodes = svg_nodes(tmp_path / "regions.svg")
    fell_back = {f"r{r.id}" for r in pipeline.regions(cm)
                 if r.compiled_as is None and r.fallback_reason and "failed to compile" in r.fallback_reason}
    assert fell_back
    for title, (_, stroke, label) in nodes.items():
        assert (stroke == "#c0392b") == (title in fell_back), (title, stroke)
        assert ("fallback" in label) == (title in fell_back)


@needs_dot
def test_graphs_and_stages_are_frames(tmp_path):
    def f(x):
        y = torch.relu(x) + 1
        torch._dynamo.graph_break()
        return torch.tanh(y) * 2
    cf = pipeline.jit(f, executors=[Claiming("fuse", tag=torch.Tag.pointwise), "torch"])
    with torch.no_grad():
        cf(torch.randn(4, 4))
    pipeline.draw(cf, tmp_path / "regions.svg")
    root = ET.parse(tmp_path / "regions.svg").getroot()
    frames = [" ".join(t.text for t in g.iter(f"{SVG}text")) for g in root.iter(f"{SVG}g")
              if g.get("class") == "cluster"]
    assert frames == ["g0 inference", "g1 inference"]


@needs_dot
def test_html_is_the_svg_in_a_page(tmp_path):
    cm, _ = trained(layers=2)
    pipeline.draw(cm, tmp_path / "regions.html")
    text = (tmp_path / "regions.html").read_text()
    assert text.startswith("<!DOCTYPE html>") and "<?xml" not in text
    svg = text[text.index("<svg"):text.index("</svg>") + len("</svg>")]
    titles = {e.text for e in ET.fromstring(svg).iter(f"{SVG}title")}
    assert {f"r{r.id}" for r in pipeline.regions(cm) if r.compiled_as is None} <= titles


def test_dot_output_needs_no_graphviz(tmp_path, monkeypatch):
    cm, _ = trained(layers=2)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no `dot` to be found
    pipeline.draw(cm, tmp_path / "regions.dot")
    text = (tmp_path / "regions.dot").read_text()
    assert text.startswith("digraph regions {")
    drawn = set(re.findall(r"^\s+(r\d+) \[label=", text, flags=re.M))
    assert drawn == {f"r{r.id}" for r in pipeline.regions(cm) if r.compiled_as is None}
    assert "f32[8, 16]" in text and "×2" in text


def test_without_graphviz_svg_writes_the_dot_and_says_how_to_render_it(tmp_path, monkeypatch):
    cm, _ = trained(layers=2)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(GraphvizMissing, match=r"install graphviz.*dot -Tsvg .*regions\.dot -o .*regions\.svg"):
        pipeline.draw(cm, tmp_path / "regions.svg")
    assert (tmp_path / "regions.dot").read_text().startswith("digraph")
    assert not (tmp_path / "regions.svg").exists()


def test_unknown_extension_is_an_error_naming_the_supported_ones(tmp_path):
    cm, _ = trained(layers=2)
    with pytest.raises(ValueError, match=r"regions\.png.*\.svg, \.dot, \.html"):
        pipeline.draw(cm, tmp_path / "regions.png")


def test_a_model_not_called_yet_is_an_error_saying_to_call_it(tmp_path):
    cm = pipeline.jit(Block(), executors=["torch"])
    with pytest.raises(RuntimeError, match=r"nothing compiled yet: call the jitted model once"):
        pipeline.draw(cm, tmp_path / "regions.svg")
    with pytest.raises(TypeError, match="returned by pipeline.jit"):
        pipeline.draw(Block(), tmp_path / "regions.svg")
    assert "draw" in pipeline.__all__
