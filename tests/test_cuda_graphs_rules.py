"""The rules deciding which stages `cuda_graphs=True` records, checked on the CPU (recording itself
runs in tests/test_cuda.py on the GPU machine)."""
import types

import torch
import torch.fx as fx

import pipeline
from ir import Stage
from pipeline import cuda_graphs

aten = torch.ops.aten


def test_a_value_off_the_gpu_keeps_both_stages_region_by_region(mlp, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "_cuda_available", lambda: True)  # as on a GPU machine, CPU tensors
    cm = pipeline.jit(mlp, executors=["torch"], cuda_graphs=True)
    x = torch.randn(2, 16, requires_grad=True)
    out = cm(x)
    torch.testing.assert_close(out, mlp(x))
    out.sum().backward()
    stats = pipeline.compile_stats(cm).cuda_graphs
    assert stats["g0 forward"].startswith("off: a value off the GPU (") and "on cpu" in stats["g0 forward"]
    assert stats["g0 backward"].startswith("off: ")


def test_a_backward_is_not_recorded_when_its_forward_is_not():
    record = types.SimpleNamespace(cuda_graphs={"forward": "off: a value off the GPU"})
    fn = lambda args: args  # noqa: E731
    assert cuda_graphs.stage_callable(fn, None, [], None, stage="backward", record=record) is fn
    assert record.cuda_graphs["backward"] == "off: its forward is not recorded"


def test_inputs_written_by_the_stage_are_found():
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    graph.call_function(aten.copy_.default, (x, y))
    graph.call_function(aten.add_.Tensor, (y,), {"other": x})
    graph.output(None)
    assert cuda_graphs._mutated_inputs(fx.GraphModule({}, graph)) == ["x", "y"]


def test_static_inputs_are_parameters_forward_and_all_but_tangents_and_seeds_backward():
    def spec(kind, name):
        return types.SimpleNamespace(kind=kind, name=name)
    forward = types.SimpleNamespace(stage=Stage.FORWARD, inputs=[spec("parameter", "p"), spec("user_input", "x"),
                                                                  spec("buffer", "b")])
    backward = types.SimpleNamespace(stage=Stage.BACKWARD, inputs=[spec("saved", "primals_1"), spec("saved", "mm"),
                                                                    spec("seed", "bwd_rng_state_0"),
                                                                    spec("tangent", "tangents_1")])
    assert cuda_graphs.static_inputs(forward) == [0, 2]
    assert cuda_graphs.static_inputs(backward) == [0, 1]
