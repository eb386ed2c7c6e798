"""Trace passes: a user pass as in the README, purity checks, provenance, stage order."""
import pytest
import torch
import torch.nn.functional as F

import pipeline
from transforms import trace_pass


@trace_pass(runs_on="after_autodiff")
def tanh_gelu(trace):
    gm = trace.editable()
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.gelu.default:
            node.kwargs = {**node.kwargs, "approximate": "tanh"}
    gm.recompile()
    return trace.derive(gm, by="tanh_gelu")


def test_user_pass_replaces_gelu_with_its_tanh_approximation(mlp):
    cm = pipeline.jit(mlp, executors=["torch"], transforms=[tanh_gelu])
    x = torch.randn(4, 16)
    with torch.no_grad():
        out = cm(x)
        expected = mlp.fc2(F.gelu(mlp.fc1(x), approximate="tanh"))
        exact = mlp.fc2(F.gelu(mlp.fc1(x)))
    assert torch.equal(out, expected)
    assert not torch.equal(out, exact)
    lowered = [t for t in pipeline.last_traces(cm) if t.provenance[-1].name == "tanh_gelu"]
    assert len(lowered) == 1 and "approximate='tanh'" in str(lowered[0])


def test_pass_runs_on_forward_and_backward_in_training(mlp):
    seen = []

    @trace_pass
    def record(trace):
        seen.append(trace.name)
        return trace.derive(trace.editable(), by="record")

    cm = pipeline.jit(mlp, executors=["torch"], transforms=[record])
    cm(torch.randn(2, 16)).sum().backward()
    assert seen == ["g0_forward", "g0_backward"]


def test_before_autodiff_pass_sees_the_torch_level_trace(mlp):
    levels = []

    @trace_pass(runs_on="before_autodiff")
    def look(trace):
        levels.append(trace.level)
        return trace.derive(trace.editable(), by="look")

    pipeline.jit(mlp, executors=["torch"], transforms=[look])(torch.randn(2, 16))
    assert levels == ["torch"]


def test_passes_of_a_stage_run_in_the_given_order(mlp):
    order = []

    def make(name):
        return trace_pass(lambda t: (order.append(name), t.derive(t.editable(), by=name))[1], name=name)

    cm = pipeline.jit(mlp, executors=["torch"], transforms=[make("b"), make("a")])
    with torch.no_grad():
        cm(torch.randn(2, 16))
    assert order == ["b", "a"]
    assert [s.name for s in pipeline.last_traces(cm)[-1].provenance] == [
        "capture", "lower (inference)", "b", "a", "dispatch: assign claims", "dispatch: keep fusible islands whole", "dispatch: partition", "dispatch: compile or load regions"]


def test_plain_function_is_a_pass_and_gets_recorded(mlp):
    def identity(trace):
        return trace
    cm = pipeline.jit(mlp, executors=["torch"], transforms=[identity])
    with torch.no_grad():
        cm(torch.randn(2, 16))
    assert "identity" in [s.name for s in pipeline.last_traces(cm)[-1].provenance]


def test_pass_that_mutates_its_input_is_an_error(mlp):
    def vandal(trace):
        for node in trace.graph.nodes:
            if node.target is torch.ops.aten.gelu.default:
                node.target = torch.ops.aten.relu.default
        return trace
    cm = pipeline.jit(mlp, executors=["torch"], transforms=[vandal])
    with pytest.raises(pipeline.PassError, match="changed its input trace"):
        cm(torch.randn(2, 16))


@pytest.mark.parametrize("stage", ["before_autodiff", "joint", "after_autodiff"])
def test_pass_that_reorders_inputs_is_an_error(mlp, stage):
    """The caller passes arguments by position: two same-shaped inputs swapped ran on each other's values."""
    @trace_pass(runs_on=stage)
    def swap_first_two_inputs(trace):
        gm = trace.editable()
        gm.graph.find_nodes(op="placeholder")[0].prepend(gm.graph.find_nodes(op="placeholder")[1])
        return trace.derive(gm, by="swap")
    cm = pipeline.jit(mlp, executors=["torch"], transforms=[swap_first_two_inputs])
    with pytest.raises(pipeline.PassError, match="reordered or renamed the inputs"):
        cm(torch.randn(2, 16)).sum().backward()


def test_pass_that_returns_no_trace_is_an_error(mlp):
    cm = pipeline.jit(mlp, executors=["torch"], transforms=[lambda t: t.module])
    with pytest.raises(pipeline.PassError, match="returned GraphModule, not a Trace"):
        cm(torch.randn(2, 16))


def test_unknown_pass_stage_is_an_error():
    with pytest.raises(ValueError, match="runs_on must be one of"):
        trace_pass(lambda t: t, runs_on="whenever")


class Bf16LogitsFp32Loss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 64).bfloat16()

    def forward(self, x):
        return self.head(x).float().log_softmax(-1).mean()


def _passes_run(cm):
    return {s.name for t in pipeline.last_traces(cm) for s in t.provenance}


def test_default_passes_are_listed_and_run_after_the_users():
    assert [p.name for p in pipeline.default_passes()] == ["causal_attention", "grouped_kv_attention", "shift_labels",
                                                        "save_policy"]
    model = Bf16LogitsFp32Loss()
    cm = pipeline.jit(model, executors=["torch"])
    cm(torch.randn(4, 8, dtype=torch.bfloat16)).backward()
    assert "save_policy" in _passes_run(cm)  # the fp32 log-probabilities are recomputed, not saved


def test_without_removes_a_default_pass_by_name():
    model = Bf16LogitsFp32Loss()
    cm = pipeline.jit(model, executors=["torch"], transforms=[pipeline.without("save_policy")])
    cm(torch.randn(4, 8, dtype=torch.bfloat16)).backward()
    assert "save_policy" not in _passes_run(cm)
    with pytest.raises(ValueError, match="no default pass named \\['save_polcy'\\]"):
        pipeline.without("save_polcy")
