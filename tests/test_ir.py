"""The IR: printing as runnable Python, the verifier, immutability, debug dumps."""
import os

import pytest
import torch
import torch.fx as fx

import pipeline
from ir import InputSpec, Trace, TraceError, python_callable, verify
from models import LlamaBlock, LlamaConfig


def inputs_for(trace: Trace, model, user_inputs):
    """Real values for a trace's inputs, found through its input specs."""
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    users = iter(user_inputs)
    return [state[s.qualname] if s.kind in ("parameter", "buffer") else next(users) for s in trace.inputs]


@pytest.fixture
def block_traces():
    block = LlamaBlock(LlamaConfig()).eval()
    x = torch.randn(2, 8, 64)
    cm = pipeline.jit(block, executors=["torch"])
    with torch.no_grad():
        expected = cm(x)
    return block, x, expected, pipeline.last_traces(cm)


def test_every_stage_is_recorded_with_provenance(block_traces):
    _, _, _, traces = block_traces
    assert [t.level for t in traces] == ["torch", "aten", "aten"]
    assert [s.name for s in traces[-1].provenance] == [
        "capture", "lower (inference)", "dispatch: assign claims", "dispatch: keep fusible islands whole",
        "dispatch: partition", "dispatch: compile or load regions"]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_printed_trace_runs_and_reproduces_the_stage(block_traces, stage):
    block, x, expected, traces = block_traces
    trace = traces[stage]
    source = str(trace)
    assert "# inputs:" in source and "parameter 'attn.wq.weight'" in source
    fn = python_callable(trace)
    with torch.no_grad():
        out = fn(*inputs_for(trace, block, [x]))
        reference = trace.module(*inputs_for(trace, block, [x]))
    out, reference = (o[0] if isinstance(o, (tuple, list)) else o for o in (out, reference))
    assert torch.equal(out, reference)
    assert torch.equal(out, expected)


def test_printed_aten_trace_shows_shapes_and_ops(block_traces):
    source = str(block_traces[3][1])
    assert "aten.mm.default(" in source and "# f32[16, 64]" in source
    assert "def g0_inference(" in source


def test_editable_copy_leaves_the_trace_unchanged(block_traces):
    trace = block_traces[3][1]
    before = trace.fingerprint()
    gm = trace.editable()
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and not node.users:
            gm.graph.erase_node(node)
    first_op = next(n for n in gm.graph.nodes if n.op == "call_function")
    first_op.target = torch.ops.aten.neg.default
    assert trace.fingerprint() == before


def _tiny_trace():
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(3)
    y = g.call_function(torch.ops.aten.sin.default, (x,))
    y.meta["val"] = torch.empty(3)
    g.output((y,))
    return Trace(fx.GraphModule({}, g), name="tiny", level="aten", inputs=[InputSpec("user_input", "x")],
                 outputs=())


def test_verifier_accepts_a_well_formed_trace():
    assert verify(_tiny_trace()).name == "tiny"


def test_verifier_rejects_missing_metadata():
    t = _tiny_trace()
    gm = t.editable()
    x, y, out = list(gm.graph.nodes)
    with gm.graph.inserting_before(out):
        z = gm.graph.call_function(torch.ops.aten.cos.default, (y,))
    out.args = ((z,),)
    with pytest.raises(TraceError, match="has no shape/dtype metadata"):
        verify(t.derive(gm, by="bad"))


def test_verifier_rejects_use_before_definition():
    t = _tiny_trace()
    gm = t.editable()
    x, y, out = list(gm.graph.nodes)
    z = gm.graph.call_function(torch.ops.aten.cos.default, (y,))
    z.meta["val"] = torch.empty(3)
    x.append(z)  # move z before y, which it uses
    out.args = ((z,),)
    with pytest.raises(TraceError, match="used|before"):
        verify(t.derive(gm, by="bad"))


def test_verifier_rejects_wrong_input_specs():
    t = _tiny_trace()
    bad = Trace(t.module, name="t", level="aten", inputs=[], outputs=())
    with pytest.raises(TraceError, match="0 input specs for 1 placeholders"):
        verify(bad)


def test_trace_level_is_checked():
    with pytest.raises(ValueError, match="level"):
        Trace(_tiny_trace().module, name="t", level="llvm", inputs=[], outputs=())


def test_debug_mode_verifies_and_dumps_every_stage(mlp, tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_DEBUG", "1")
    monkeypatch.setenv("PIPELINE_DUMP_DIR", str(tmp_path))
    cm = pipeline.jit(mlp, executors=["torch"])
    with torch.no_grad():
        cm(torch.randn(2, 16))
    files = sorted(os.listdir(tmp_path / str(os.getpid())))
    assert files == ["g0_captured.01.capture.py", "g0_inference.02.lower_inference.py",
                     "g0_inference.03.dispatch_compile_or_load_regions.py"]
    text = (tmp_path / str(os.getpid()) / files[1]).read_text()
    assert "aten.addmm.default" in text
