"""The executor interface: claims as tables, capabilities opted into, a flops hook, no imports across."""
import pathlib

import torch
import torch.fx as fx

import executors
from executors import Executor
from executors.base import Cacheable, PerModel, PreparesGraph
from executors.claims import ClaimTable
from executors.plan import gemm_flops
from executors.te_executor import te_executor  # registers pipeline_te::linear

aten = torch.ops.aten
ROOT = pathlib.Path(__file__).resolve().parent.parent


def _node(target, *values, out=None) -> fx.Node:
    """A call_function node on placeholders carrying `values` as their `meta["val"]`."""
    graph = fx.Graph()
    args = []
    for v in values:
        p = graph.placeholder(f"a{len(args)}")
        p.meta["val"] = v
        args.append(p)
    node = graph.call_function(target, tuple(args))
    node.meta["val"] = out
    return node


def test_claim_table_claims_registered_ops_and_asks_their_checker():
    table = ClaimTable()
    table.register(aten.mul.Tensor, aten.add.Tensor)
    table.register(aten.sum.dim_IntList, checker=lambda node: node.meta["val"].dim() == 0)
    scalar, vector = _node(aten.sum.dim_IntList, out=torch.ones(())), _node(aten.sum.dim_IntList, out=torch.ones(2))
    assert table.claims(aten.mul.Tensor, scalar) and table.claims(aten.add.Tensor, scalar)
    assert table.claims(aten.sum.dim_IntList, scalar) and not table.claims(aten.sum.dim_IntList, vector)
    assert not table.claims(aten.div.Tensor, scalar)
    assert aten.mul.Tensor in table and len(table) == 3


def test_default_claims_op_reads_the_executors_table():
    table = ClaimTable()
    table.register(aten.mul.Tensor)

    class Tabled(Executor):
        name, claims_table = "tabled", table

    node = _node(aten.mul.Tensor, torch.ones(2), torch.ones(2))
    assert Tabled().claims(node) and not Tabled().claims(_node(aten.div.Tensor, torch.ones(2), torch.ones(2)))
    assert te_executor.claims_op(torch.ops.pipeline_te.linear.default, node)
    assert not te_executor.claims_op(aten.mm.default, node)


def test_built_in_executors_opt_into_the_capabilities_they_implement():
    assert isinstance(executors.torch, Cacheable) and isinstance(executors.inductor, Cacheable)
    assert isinstance(executors.te, PerModel) and isinstance(executors.te, PreparesGraph)
    # every built-in one is cacheable: te and nvfuser store nothing and rebuild from the region graph
    assert isinstance(executors.te, Cacheable) and isinstance(executors.nvfuser, Cacheable)
    assert not isinstance(executors.nvfuser, PerModel)
    # the pipeline calls `before_call` only for executors that override it (a Python call per step)
    assert type(executors.inductor).before_call is Executor.before_call
    assert type(executors.te).before_call is not Executor.before_call


def test_an_executor_without_capabilities_gets_neutral_hooks():
    class Plain(Executor):
        name = "plain"

    plain = Plain()
    assert plain.for_model() is plain and plain.extra_state() == {} and plain.load_extra_state({}) == set()
    assert plain.prepare("trace") == ("trace", []) and plain.passes_before_prepare() == ()
    assert plain.decompositions_before_partition() == {} and plain.flops(_node(aten.mm.default)) is None
    assert "no serializable artifact" in plain.artifact_unsupported_reason(None, [])


def test_te_counts_its_own_gemm_flops_and_the_core_counts_aten_matmuls():
    x, w = torch.empty(4, 8, 16, device="meta"), torch.empty(32, 16, device="meta")
    y = torch.empty(4, 8, 32, device="meta")
    graph = fx.Graph()
    xn, wn = graph.placeholder("x"), graph.placeholder("w")
    xn.meta["val"], wn.meta["val"] = x, w
    for fp8 in (False, True):
        node = graph.call_function(torch.ops.pipeline_te.linear.default, (xn, wn, None, fp8, -1, -1))
        node.meta["val"] = [y]
        assert te_executor.flops(node) == (2 * 32 * 16 * 32, fp8)
        assert gemm_flops(node, [executors.torch, te_executor]) == (2 * 32 * 16 * 32, fp8)
        assert gemm_flops(node) == (0, False)  # nobody asked knows the op
    mm = _node(aten.mm.default, torch.empty(4, 16, device="meta"), torch.empty(16, 8, device="meta"))
    assert te_executor.flops(mm) is None and gemm_flops(mm, [te_executor]) == (2 * 4 * 16 * 8, False)


def test_executors_and_transforms_do_not_import_each_other():
    for folder, other in (("executors", "transforms"), ("transforms", "executors")):
        for path in (ROOT / folder).glob("*.py"):
            text = path.read_text()
            assert f"from {other}" not in text and f"import {other}" not in text, f"{path} imports {other}"


def test_one_list_of_linear_ops():
    from ir.torch_ops import LINEARS
    from transforms.group_linears import LINEARS as grouped
    assert grouped is LINEARS and torch.nn.functional.linear in LINEARS
    assert "_LINEARS" not in (ROOT / "executors" / "te_executor.py").read_text()


def test_a_region_forward_an_executor_returns_runs_its_code_not_the_lazy_stub():
    """Regions are made without their Python code (partition makes it when run); an executor that
    returns `gm.forward`, as the README's does, gets the code itself, not a stub that would check
    for code on every call."""
    import pipeline
    from torch.fx._lazy_graph_module import _LazyGraphModule

    class Forward(Executor):
        name, kind = "forward", "fusion"

        def claims_op(self, op, node):
            return True

        def compile_region(self, gm, example_inputs):
            return gm.forward

    cm = pipeline.jit(lambda x: (x.sin() * 2).cos(), executors=[Forward()], cache=False)
    x = torch.randn(4)
    torch.testing.assert_close(cm(x), (x.sin() * 2).cos())
    fns = [m.fn for t in pipeline.last_traces(cm) for m in t.module.children() if hasattr(m, "fn")]
    assert fns and all(getattr(fn, "__func__", None) not in (None, _LazyGraphModule._lazy_forward) for fn in fns)
