"""Issue 22: a region whose code names a shape symbol that none of its inputs binds.

A backward that pads by a saved `neg = s48 - 10` back to size `s48` got `neg` but not `s48`, and
Inductor's code failed with `NameError: name 's48' is not defined`. Regions now receive the symbols
they need (`executors/symbol_inputs.py`), and `ir.symbols.check_symbols_bound` reports any that is
missing at build time.
"""
import operator

import pytest
import torch
import torch.fx as fx

import pipeline
from executors.symbol_inputs import pass_symbol_inputs
from ir.symbols import UnboundSymbolError, check_symbols_bound, unbound_symbols


def _same_named(body: str):
    """`def fn(t0): return <body>`, compiled from the same file name and line every time: Dynamo's
    automatic-dynamic state of one carries over to the next, as for one function re-defined."""
    namespace = {"torch": torch}
    exec(compile(f"def fn(t0):\n    return {body}\n", "<issue22>", "exec"), namespace)
    return namespace["fn"]


def _grad(fn, x):
    t = x.detach().clone().requires_grad_(True)
    out = fn(t)
    out = torch.view_as_real(out) if out.is_complex() else out
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), t.grad


@pytest.mark.inductor
def test_same_named_functions_then_padding_fft_backward():
    """Two shapes make every dim of `t0` dynamic; the FFT's backward then saves `s48 - 10`. With the
    sizes symbolic, the padding's region needs `s48` from the stage's inputs."""
    sequence = [("t0.sin()", (3, 4, 5)), ("t0.cos()", (4, 5, 6)),
                ('torch.fft.fft(t0, n=10, dim=1, norm="ortho")', (5, 6, 7)),
                ('torch.fft.rfftn(t0, s=(3, 10), dim=(1, 2), norm="ortho")', (5, 6, 7))]
    for body, shape in sequence:
        fn = _same_named(body)
        x = torch.randn(shape)
        cm = pipeline.jit(fn, executors=["inductor", "torch"])
        (out, grad), (want_out, want_grad) = _grad(cm, x), _grad(fn, x)
        torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-4)
        failed = [r.fallback_reason for r in pipeline.regions(cm)
                  if r.fallback_reason and "failed to compile" in r.fallback_reason]
        assert not failed, f"{body}: {failed}"
    symbolic = [r for r in pipeline.regions(cm) if "SymInt" in " ".join(r.input_shapes)]
    assert symbolic, "the last function no longer compiles with dynamic shapes: the test lost its point"


def _symbols():
    """A fake mode and two backed symbols s0 = 4, s1 = 7 of its shape env."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    s0, s1 = (env.create_symintnode(env.create_symbol(v, ConstantSource(name)), hint=v)
              for name, v in (("a", 4), ("b", 7)))
    return mode, s0, s1


def _padding_region(with_symbol: bool) -> fx.GraphModule:
    """A hand-made region: pads x (s0 x 10) by a SymInt `neg = s1 - 10` back to s0 x s1, and takes
    s1 itself only `with_symbol`."""
    mode, s0, s1 = _symbols()
    with mode:
        x = torch.empty(s0, 10)
        neg = s1 - 10
        out = torch.empty(s0, s1)  # what the padding makes
    g = fx.Graph()
    px, pneg = g.placeholder("x"), g.placeholder("neg")
    px.meta["val"], pneg.meta["val"] = x, neg
    if with_symbol:
        g.placeholder("s1").meta["val"] = s1
    pad = g.call_function(torch.ops.aten.constant_pad_nd.default, (px, [0, pneg]))
    pad.meta["val"] = out
    g.output((pad,))
    return fx.GraphModule(torch.nn.Module(), g)


def test_check_names_the_unbound_symbol_region_and_op():
    region = _padding_region(with_symbol=False)
    s1 = str(next(n for n in region.graph.nodes if n.name == "neg").meta["val"].node.expr.free_symbols.pop())
    problems = unbound_symbols(region)
    assert [p.symbol for p in problems] == [s1]
    assert problems[0].node == "neg"  # the first reference: the SymInt input s1 - 10
    with pytest.raises(UnboundSymbolError, match=rf"region 7 \(backward\): .*{s1} \(in the value of input 'neg', "
                                                 r"op aten.constant_pad_nd.default, which reads it\)"):
        check_symbols_bound(region, "region 7 (backward)")


def test_check_names_the_op_whose_value_needs_the_symbol():
    """An op whose output is sized by a symbol no input carries (its metadata made by hand)."""
    mode, s0, s1 = _symbols()
    with mode:
        x = torch.empty(s0, 10)
        out = torch.empty(s0, s1)
    g = fx.Graph()
    px = g.placeholder("x")
    px.meta["val"] = x
    grown = g.call_function(torch.ops.aten.sin.default, (px,))
    grown.meta["val"] = out
    g.output((grown,))
    with pytest.raises(UnboundSymbolError, match=rf"{s1.node.expr} \(in the value of node 'sin_default', "
                                                 r"op aten.sin.default\)"):
        check_symbols_bound(fx.GraphModule(torch.nn.Module(), g), "region 0 (forward)")


def test_bound_and_static_regions_pass():
    check_symbols_bound(_padding_region(with_symbol=True), "region 0")
    g = fx.Graph()
    p = g.placeholder("x")
    p.meta["val"] = torch.empty(3, 4, device="meta")
    y = g.call_function(torch.ops.aten.sin.default, (p,))
    y.meta["val"] = torch.empty(3, 4, device="meta")
    g.output((y,))
    assert unbound_symbols(fx.GraphModule(torch.nn.Module(), g)) == []


def test_regions_receive_the_symbols_they_need():
    """A stage that binds s1 (a SymInt input) calls a region that needs it but was not given it:
    `pass_symbol_inputs` adds it as the region's input, and the check passes."""
    region = _padding_region(with_symbol=False)
    x_val, neg_val = (n.meta["val"] for n in region.graph.nodes if n.op == "placeholder")
    s1_val = neg_val + 10
    g = fx.Graph()
    s1, x, neg = g.placeholder("s1"), g.placeholder("x"), g.placeholder("neg")
    s1.meta["val"], x.meta["val"], neg.meta["val"] = s1_val, x_val, neg_val
    root = torch.nn.Module()
    root.region0 = region
    call = g.call_module("region0", (x, neg))
    out = g.call_function(operator.getitem, (call, 0))
    g.output((out,))
    stage = fx.GraphModule(root, g)
    pass_symbol_inputs(stage)
    call = next(n for n in stage.graph.nodes if n.op == "call_module")
    assert call.args == (x, neg, s1)
    check_symbols_bound(stage.region0, "region 0")
