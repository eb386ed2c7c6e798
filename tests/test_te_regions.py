"""With `te` listed, what lies between TE's linears compiles on Inductor: checked on the CPU with
TE's GEMM replaced by a matmul stand-in (`te_on_cpu` in conftest.py; TE itself needs a GPU), forward
and backward against eager."""
import copy

import pytest
import torch
import torch.nn as nn

import pipeline
from helpers import assert_llama_step_matches_eager
from models import LlamaConfig


@pytest.mark.parametrize("bias", [False, True])
def test_a_te_region_of_one_op_runs_without_generated_code_and_matches_eager(te_on_cpu, bias):
    """Each TE region (one linear or its backward, and the items taken from its result) is built as a
    closure, not a generated module: a warm start makes every one of them again. A region with more in
    it still gets generated code and gives the same values."""
    from executors.te_executor import _one_op
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=bias), nn.GELU(), nn.Linear(32, 8, bias=bias))
    eager = copy.deepcopy(model)
    x = torch.randn(4, 16, requires_grad=True)
    xe = x.detach().clone().requires_grad_()
    cm = pipeline.jit(model, executors=[te_on_cpu, "torch"], cache=False)
    out, ref = cm(x), eager(xe)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, xe.grad)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    te_regions = [m for t in pipeline.last_traces(cm) if t.provenance[-1].name.startswith("dispatch")
                  for m in t.module.children() if m.region.executor == "te"]
    assert len(te_regions) == 4
    assert all(m.fn.__qualname__ == _one_op.__qualname__ + ".<locals>.run" for m in te_regions)
    # a region with a second op: generated code, the same values
    region = te_regions[0]
    graph = region.source.graph
    first_out = graph.output_node().args[0][0]
    with graph.inserting_before(graph.output_node()):
        doubled = graph.call_function(torch.ops.aten.mul.Tensor, (first_out, 2.0))
    graph.output_node().args = ((doubled, *graph.output_node().args[0][1:]),)
    region.source.recompile()
    inputs = [torch.randn(v.meta["val"].shape) if isinstance(v.meta["val"], torch.Tensor) else v.meta["val"]
              for v in graph.nodes if v.op == "placeholder"]
    fn = te_on_cpu.compile_region(region.source, inputs)
    assert fn.__qualname__ != _one_op.__qualname__ + ".<locals>.run"
    graph.output_node().args = ((first_out, *graph.output_node().args[0][1:]),)
    graph.erase_node(doubled)
    region.source.recompile()
    single = te_on_cpu.compile_region(region.source, inputs)
    torch.testing.assert_close(fn(*inputs)[0], 2 * single(*inputs)[0])


@pytest.mark.inductor
def test_regions_between_te_linears_compile_on_inductor(te_on_cpu):
    """Every non-linear region of a Llama and its loss runs on Inductor, none falls back, and the
    second layer reuses the first layer's compiled regions.
    Before elements of multi-output ops stayed with their op, each attention region returned the
    attention's whole output tuple (its logsumexp is saved for the backward) and the loss region
    took it in: Inductor failed on both and they ran op by op on torch (10 ms a step on the H200)."""
    config = LlamaConfig(vocab=512, dim=128, layers=2, heads=4, kv_heads=2, hidden=256, max_seq=32)
    cm = assert_llama_step_matches_eager(config, [te_on_cpu, "inductor"])

    table = pipeline.regions(cm)
    assert {r.executor for r in table} == {"te", "inductor"}, str(table)
    assert not [r.fallback_reason for r in table if r.fallback_reason], str(table)
    assert sum(r.executor == "te" for r in table) == 2 * 9  # 2 x (qkv, wo, w1+w3, w2) + head; forward, backward
    # the second layer's regions run the code compiled for the first layer's
    twins = [r for r in table if r.compiled_as is not None and r.executor == "inductor"]
    assert len(twins) >= 6, str([(r.id, r.compiled_as) for r in table])
    # each norm's weight gradient is summed in its layer's region, not all of them in the last one
    last_backward = [r for r in table if r.stage == "backward"][-1]
    assert last_backward.ops.count("sum") <= 2, last_backward.ops  # the first norm's weight and input
