"""`decompose_graph`: Inductor's decompositions spliced in op by op must give the graph that
re-tracing the whole region with `make_fx(decomposition_table=...)` gives — the same ops, the same
results — without sharing fake values between nodes, and leave its input alone."""
import collections

import pytest
import torch
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

import pipeline
from executors.decompose import NotDecomposable, decompose_graph
from executors.inductor_executor import _decompositions, _inductor_decomposed
from models import LanguageModelLoss, Llama, LlamaConfig


def _lowered_stages():
    torch.manual_seed(0)
    model = LanguageModelLoss(Llama(LlamaConfig(layers=2)), fp32_loss=True).to(torch.bfloat16)
    cm = pipeline.jit(model, executors=["torch"])
    cm(torch.randint(0, 256, (2, 16))).backward()
    stages = [t.module for t in pipeline.last_traces(cm) if t.name.endswith(("_forward", "_backward"))
              and t.provenance[-1].name.startswith("lower")]
    assert len(stages) == 2, [t.name for t in pipeline.last_traces(cm)]
    return stages


def _real(value, generator):
    if value.dtype.is_floating_point:
        data = torch.randn(value.shape, dtype=torch.float32, generator=generator).to(value.dtype)
    else:
        data = torch.randint(0, 8, value.shape, generator=generator, dtype=value.dtype)
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype).copy_(data)


def _is_view(node):
    schema = getattr(node.target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None \
        and not schema.returns[0].alias_info.is_write and isinstance(node.meta.get("val"), torch.Tensor)


def _storage(value):
    from torch.multiprocessing.reductions import StorageWeakRef
    return StorageWeakRef(value.untyped_storage())


def _ops(gm):
    return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("stage", [0, 1], ids=["forward", "backward"])
def test_op_by_op_decomposition_matches_retracing_the_whole_graph(stage):
    gm = _lowered_stages()[stage]
    table = _decompositions(False)
    fakes = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    code_before = gm.code
    with detect_fake_mode(fakes):
        by_op = decompose_graph(gm, table)
    whole = _whole_retrace(gm, fakes)
    assert gm.code == code_before, "decompose_graph must work on a copy"
    assert _ops(by_op) == _ops(whole)
    assert _ops(by_op) != _ops(gm), "the table should decompose something in a Llama step"
    values = [n.meta["val"] for n in by_op.graph.nodes if n.op == "call_function"]
    assert len({id(v) for v in values}) == len(values), "each node needs its own fake value"
    views = [n for n in by_op.graph.nodes if _is_view(n)]
    assert views
    for view in views:  # a view's fake value shares its base's storage, as Inductor's passes expect
        base = view.args[0].meta["val"]
        assert _storage(view.meta["val"]) == _storage(base), view.format_node()
    g = torch.Generator().manual_seed(0)
    inputs = [_real(v, g) for v in fakes]
    torch.testing.assert_close(by_op(*inputs), whole(*inputs), rtol=0, atol=0, equal_nan=True)


def test_symbolic_shapes_are_retraced_whole():
    def f(x, w):
        return (torch.nn.functional.silu(x @ w.t()).sum(-1),)
    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(4, 8), torch.randn(6, 8))
    with pytest.raises(NotDecomposable, match="symbolic|static shape"):
        decompose_graph(gm, _decompositions(False))
    fakes = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    decomposed = _inductor_decomposed(gm, fakes)  # falls back to make_fx over the whole graph
    x, w = torch.randn(5, 8), torch.randn(6, 8)
    torch.testing.assert_close(decomposed(x, w)[0], f(x, w)[0])


def _whole_retrace(gm, fakes):
    """What the op-by-op result must equal: the whole graph re-traced through Inductor's table."""
    with detect_fake_mode(fakes):
        return make_fx(gm, decomposition_table=_decompositions(False), tracing_mode="real")(*fakes)


def _by_op_and_whole(fn, *inputs):
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    fakes = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    return _inductor_decomposed(gm, fakes), _whole_retrace(gm, fakes)


@pytest.mark.parametrize("name, fn", [
    # one trace per signature: a trace of lerp(x, x, w) binds both slots to one input
    ("the same input in two slots", lambda x, a: (torch.ops.aten.lerp.Scalar(x, x, 0.3),
                                                  torch.ops.aten.lerp.Scalar(x, a, 0.3))),
    # 0.0 and -0.0 hash alike
    ("signed zeros", lambda x, a: (1 / torch.full_like(x, 0.0), 1 / torch.full_like(x, -0.0))),
    # a decomposition making a tensor constant: the whole graph is re-traced instead
    ("a tensor constant", lambda x, a: (torch.ops.aten.searchsorted.Scalar(torch.sort(a).values, 0.3) + x,)),
])
def test_decomposed_graph_computes_what_the_ops_compute(name, fn):
    x, a = torch.randn(4), torch.randn(4)
    by_op, whole = _by_op_and_whole(fn, x, a)
    torch.testing.assert_close(by_op(x, a), fn(x, a), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(by_op(x, a), whole(x, a), rtol=0, atol=0)
