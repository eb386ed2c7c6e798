"""group_linears: linears on the same input become one linear on stacked weights (fewer, larger GEMMs)."""
import copy

import pytest
import sys
import types

import torch
import torch.nn.functional as F

import pipeline
from models import Llama, LlamaConfig
from transforms import group_linears
from transforms.group_linears import LINEARS

CONFIG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, max_seq=16)


def linear_count(trace):
    return sum(1 for n in trace.module.graph.nodes if n.op == "call_function" and n.target in LINEARS)


def grouped_trace(cm):
    return next(t for t in pipeline.last_traces(cm) if t.provenance[-1].name == "group_linears")


def test_llama_qkv_and_gate_up_become_one_linear_each_and_train_like_eager():
    torch.manual_seed(0)
    model = Llama(CONFIG)
    eager = copy.deepcopy(model)
    tokens = torch.randint(0, CONFIG.vocab, (2, 16))
    cm = pipeline.jit(model, executors=["torch"], transforms=[group_linears()])
    out, ref = cm(tokens), eager(tokens)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.square().mean().backward()
    ref.square().mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    # per layer: q, k, v -> 1 and gate, up -> 1; wo, down and the head stay: 2 * 7 + 1 = 15 -> 2 * 4 + 1
    captured = next(t for t in pipeline.last_traces(cm) if t.name.endswith("_captured"))
    assert linear_count(captured) == 15 and linear_count(grouped_trace(cm)) == 9


@pytest.mark.parametrize("with_te", [False, True])
def test_stacked_weights_are_rebuilt_in_the_backward_not_saved(with_te, request):
    """Saving the stacked weights for the backward GEMM would keep a second copy of every grouped
    weight alive from forward to backward; the backward concatenates them again instead."""
    executors = [request.getfixturevalue("te_on_cpu"), "torch"] if with_te else ["torch"]
    torch.manual_seed(0)
    model = Llama(CONFIG)
    eager = copy.deepcopy(model)
    tokens = torch.randint(0, CONFIG.vocab, (2, 16))
    cm = pipeline.jit(model, executors=executors, transforms=[] if with_te else [group_linears()])
    cm(tokens).square().mean().backward()
    eager(tokens).square().mean().backward()
    traces = pipeline.last_traces(cm)
    forward, backward = (next(t for t in traces if t.name.endswith(s)) for s in ("_forward", "_backward"))
    saved = forward.module.graph.output_node().args[0]
    stacks = [n for n in forward.module.graph.nodes if n.target is torch.ops.aten.cat.default
              and all(a.op == "placeholder" for a in n.args[0])]  # the stacked weights
    assert len(stacks) == 2 * CONFIG.layers and not set(stacks) & set(saved), forward.module.code
    rebuilt = [n for n in backward.module.graph.nodes if n.target is torch.ops.aten.cat.default
               and all(a.op == "placeholder" for a in n.args[0])]
    assert len(rebuilt) == 2 * CONFIG.layers, backward.module.code
    for (name, p), (_, e) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, e.grad, rtol=1e-4, atol=1e-6, msg=name)


class ThreeHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 6)
        self.c = torch.nn.Linear(8, 5, bias=False)
        self.scale = torch.nn.Parameter(torch.ones(3, 8))

    def forward(self, x):
        y = self.a(x) + self.b(x)[..., :4]
        c = self.c(x)
        late = F.linear(x, self.scale * 2)      # no bias like c, but its weight is computed after c
        return y, c, late


def test_only_linears_with_matching_bias_and_ready_weights_are_grouped():
    torch.manual_seed(0)
    model = ThreeHeads()
    eager = copy.deepcopy(model)
    x = torch.randn(5, 8)
    cm = pipeline.jit(model, executors=["torch"], transforms=[group_linears()])
    for got, want in zip(cm(x), eager(x)):
        torch.testing.assert_close(got, want)
    # a + b (both with bias) join; c (no bias) and `late` (weight computed later) stay alone
    assert linear_count(grouped_trace(cm)) == 3


def test_no_group_leaves_the_trace_alone():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    cm = pipeline.jit(model, executors=["torch"], transforms=[group_linears()])
    cm(torch.randn(2, 8))
    captured = next(t for t in pipeline.last_traces(cm) if t.name.endswith("_captured"))
    assert grouped_trace(cm).module is captured.module  # the pass returned its input


def test_te_groups_linears_when_asked_and_names_the_state_after_the_first(monkeypatch):
    """With TE's `group_linears` option each group is one `pipeline_te::linear` (checked on the CPU
    up to where TE itself would run)."""
    from executors.te_executor import TEExecutor

    class DelayedScaling:
        margin, amax_history_len, amax_compute_algo, scaling_factor_compute_algo = 0, 8, "max", None

    monkeypatch.setattr(TEExecutor, "unavailable_reason", lambda self: None)
    monkeypatch.setattr(TEExecutor, "_reject", lambda self, node: None)
    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.cpp_extensions"):
        # empty modules: the real TE (on the GPU machine) must not be handed these CPU tensors
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    model = Llama(CONFIG).bfloat16()
    te = TEExecutor().fp8(DelayedScaling()).options(group_linears=True)
    assert te.use_fp8 and te.recipe is not None and te.group_linears
    cm = pipeline.jit(model, executors=[te, "torch"])
    with pytest.raises(Exception):  # TE's kernels need a GPU
        cm(torch.randint(0, CONFIG.vocab, (2, 16)))
    te_ops = [n for t in pipeline.last_traces(cm) if t.name == "g0_forward"
              for n in t.module.graph.nodes if n.target is torch.ops.pipeline_te.linear.default]
    assert len(te_ops) == 9
    names = sorted(cm._state.config.executors[0].scaling.names)
    assert names == sorted([f"layers.{i}.{m}.weight" for i in range(2)
                            for m in ("attn.wq", "attn.wo", "mlp.w1", "mlp.w2")] + ["head.weight"])


class MergedView(torch.nn.Module):
    """Views one output with its last dim merged into another, which a slice of a stacked output
    cannot do: that piece is made contiguous, the other stays a view."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 6)

    def forward(self, x):
        return self.a(x).view(x.shape[0], -1).sum(-1) + self.b(x).view(x.shape[0], x.shape[1], 2, 3).sum((1, 2, 3))


def test_a_grouped_output_that_must_be_merged_by_view_is_made_contiguous():
    torch.manual_seed(0)
    model = MergedView()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 3, 8)
    cm = pipeline.jit(model, executors=["torch"], transforms=[group_linears()])
    out = cm(x)
    torch.testing.assert_close(out, eager(x))
    assert len(pipeline.regions(cm)) > 0  # compiled, not run in eager
    grouped = grouped_trace(cm)
    assert linear_count(grouped) == 1
    assert sum(1 for n in grouped.module.graph.nodes if n.op == "call_method" and n.target == "contiguous") == 1


class TwoOnOneInput(torch.nn.Module):
    def __init__(self, between):
        super().__init__()
        self.a, self.b, self.between = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), between

    def forward(self, x):
        h = x * 2
        y = self.a(h)
        if self.between == "no_grad":
            with torch.no_grad():
                target = self.b(h)
            return ((y - target) ** 2).mean()
        if self.between == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                t = self.b(h)
            return y.sum() + t.float().sum()
        if self.between == "as_strided":  # reads the output's own strides: a slice of the stacked output has others
            return y.as_strided((4, 8), (8, 1)).sum() * self.b(h).sum()
        h.add_(1.0)  # written in place between the two
        return (y + self.b(h)).sum()


@pytest.mark.parametrize("between", ["no_grad", "autocast", "in place", "as_strided"])
def test_linears_are_not_joined_across_a_mode_change_or_a_write_nor_sliced_under_as_strided(between):
    torch.manual_seed(0)
    model, x = TwoOnOneInput(between), torch.randn(4, 8)
    eager = copy.deepcopy(model)
    with torch.set_grad_enabled(between != "in place"):  # eager cannot differentiate through the write
        cm = pipeline.jit(model, executors=["torch"], transforms=[group_linears()])
        out, expected = cm(x), eager(x)
    torch.testing.assert_close(out, expected)
    if between != "in place":
        out.backward()
        expected.backward()
        for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=name)
    # joined under as_strided only, its output copied first
    assert linear_count(grouped_trace(cm)) == (1 if between == "as_strided" else 2)
