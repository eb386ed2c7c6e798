"""Donated buffers: saved activations that nothing reads after the backward may be overwritten by
the region that reads them last (AOTAutograd's `bw_donated_idxs`), so Inductor reuses their
memory as it does inside torch.compile, and no other region ever sees an overwritten input."""
import operator
import re

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import pipeline
from executors.base import Executor, RebuiltFromGraph
from executors.graph_utils import donated_inputs
from executors.inductor_executor import inductor_executor
from executors.donation import mark_donated_inputs
from helpers import assert_step_matches_eager
from models import LanguageModelLoss, Llama, LlamaConfig

aten = torch.ops.aten


class Recording(Executor):
    """Claims ops by a predicate and runs regions as they are; logs (stage inputs, donated inputs)."""

    def __init__(self, name, kind, claim, log):
        self.name, self.kind, self.claim, self.log = name, kind, claim, log

    def claims_op(self, op, node):
        return self.claim(op)

    def compile_region(self, gm, example_inputs):
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self.log.append((names, [names[i] for i in donated_inputs(gm)]))
        return gm.forward


def sin_mm_tanh_mm(x, w):
    # the backward reads the saved tanh in two pointwise regions, one on each side of an mm
    return ((x.sin() @ w).tanh() @ w.t()).mul(x.sin()).sum()


def test_a_saved_activation_is_donated_only_to_the_last_region_reading_it():
    log = []
    mm = Recording("mm", "operator", lambda op: op is aten.mm.default, log)
    pointwise = Recording("pointwise", "fusion", lambda op: op is not aten.mm.default, log)
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    cf = pipeline.jit(sin_mm_tanh_mm, executors=[mm, pointwise])
    cf(x, w).backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    sin_mm_tanh_mm(x2, w2).backward()
    torch.testing.assert_close((x.grad, w.grad), (x2.grad, w2.grad))

    backward = log[len(log) - sum(1 for t in pipeline.last_traces(cf) if t.name.endswith("_backward")
                                  for n in t.module.graph.nodes if n.op == "call_module"):]
    donated = [(k, name) for k, (_, names) in enumerate(backward) for name in names]
    assert donated, f"no backward region got a donated input: {backward}"
    read_twice = 0
    for k, name in donated:
        readers = [j for j, (inputs, _) in enumerate(backward) if name in inputs]
        assert readers[-1] == k, f"{name} donated to backward region {k}, but region {readers[-1]} reads it later"
        read_twice += len(readers) > 1
    assert read_twice, "the test should have a saved tensor read by two backward regions"


def _stage_with_a_view_read_later(view_aliases: bool) -> fx.GraphModule:
    """A backward stage of three regions: region0 returns a view of the saved input `a` (or, when
    `view_aliases` is False, a tensor of its own), region1 is the last region to read `a` itself,
    region2 reads region0's output after it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        a = torch.empty(4, 4)
        view = a.view(16) if view_aliases else torch.empty(16)
        other = torch.empty(4, 4)
    root = torch.nn.Module()
    graph = fx.Graph()
    inp = graph.placeholder("a")
    inp.meta["val"] = a
    outputs = []
    for k, (arg, value) in enumerate([(inp, view), (inp, other), (None, other)]):
        sub = fx.Graph()
        x = sub.placeholder("x")
        sub.output((x,))
        root.add_module(f"region{k}", fx.GraphModule(torch.nn.Module(), sub))
        call = graph.call_module(f"region{k}", (arg if arg is not None else outputs[0],))
        out = graph.call_function(operator.getitem, (call, 0))
        out.meta["val"] = value
        outputs.append(out)
    graph.output((outputs[1], outputs[2]))
    return fx.GraphModule(root, graph)


@pytest.mark.parametrize("view_aliases", [True, False])
def test_an_input_is_not_donated_while_a_view_of_it_is_read_later(view_aliases):
    gm = _stage_with_a_view_read_later(view_aliases)
    mark_donated_inputs(gm, [0])
    donated = {name: donated_inputs(gm.get_submodule(name)) for name in ("region0", "region1")}
    assert donated == {"region0": [], "region1": [] if view_aliases else [0]}


def test_outputs_of_an_executor_that_may_alias_count_as_its_inputs_memory():
    """region0's output is a fresh tensor in the trace, but its executor may return its input."""
    gm = _stage_with_a_view_read_later(view_aliases=False)
    next(n for n in gm.graph.nodes if n.target == "region0").meta["executor"] = "aliasing"
    mark_donated_inputs(gm, [0], may_alias={"aliasing"})
    assert donated_inputs(gm.get_submodule("region1")) == []


class Transposes(Executor):
    """An operator executor taking transposes: it hands a view of a saved tensor to the region
    that also reads the saved tensor itself."""
    name, kind = "transposes", "operator"

    def claims_op(self, op, node):
        return op in (aten.t.default, aten.permute.default)

    def compile_region(self, gm, example_inputs):
        return gm.forward


def _gram(x, w):
    y = x @ w
    return (y @ y.t()).sin().sum() + (y * y).sum()


def test_a_region_reading_a_saved_tensor_and_a_view_of_it_does_not_overwrite_it():
    torch.manual_seed(0)
    x, w = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True)
    cf = pipeline.jit(_gram, executors=[Transposes(), "inductor"])
    cf(x, w).backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    _gram(x2, w2).backward()
    torch.testing.assert_close((x.grad, w.grad), (x2.grad, w2.grad), rtol=1e-4, atol=2e-3)


def _pointwise(x, y):
    return ((x * 2 + y).sin(),)


def _compile_donating(index):
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    gm = make_fx(_pointwise)(x, y)
    if index is not None:
        [n for n in gm.graph.nodes if n.op == "placeholder"][index].meta["donated"] = True
    return inductor_executor.compile_region(gm, [x, y]), x, y


def test_inductor_writes_into_the_donated_input_and_only_that_one():
    shares = []
    for index in (0, None, 1):  # identical graphs: Inductor's own cache must keep them apart
        region, x, y = _compile_donating(index)
        xx, yy = x.clone(), y.clone()
        out = region(xx, yy)[0]
        torch.testing.assert_close(out, _pointwise(x, y)[0])
        shares.append((out.data_ptr() == xx.data_ptr(), out.data_ptr() == yy.data_ptr()))
        if index != 0:
            assert torch.equal(xx, x)
        if index != 1:
            assert torch.equal(yy, y)
    assert shares == [(True, False), (False, False), (False, True)]


def test_inductor_backward_reuses_saved_activations_and_matches_eager():
    torch.manual_seed(0)
    model = LanguageModelLoss(Llama(LlamaConfig(layers=2)))
    jitted = pipeline.jit(model, executors=["inductor"])
    assert_step_matches_eager(model, jitted, torch.randint(0, 256, (2, 16)), rtol=1e-5, atol=1e-6)
    backward = [t for t in pipeline.last_traces(jitted) if t.name.endswith("_backward")][-1]  # dispatched
    sources = [m.fn.compiled.source_code for _, m in backward.module.named_children()
               if getattr(getattr(m, "fn", None), "compiled", None) is not None]
    assert sources and any(re.search(r"reinterpret_tensor\(donated\d+.*# reuse", s) for s in sources)


class Overwrites(RebuiltFromGraph):
    """A fusion executor that, as a region reusing a donated input's memory would, leaves garbage in it."""
    name, kind = "overwrites", "fusion"

    def __init__(self):
        self.overwritten = 0

    def claims_op(self, op, node):
        return True

    def compile_region(self, gm, example_inputs):
        donated = donated_inputs(gm)

        def run(*args):
            out = gm(*args)
            for i in donated:
                args[i].fill_(float("nan"))
                self.overwritten += 1
            return out
        return run


def _step_twice_keeping_the_graph(cf, x, w):
    loss = cf(x, w)
    loss.backward(retain_graph=True)
    loss.backward()


@pytest.mark.parametrize("cache", [True, False])
def test_a_backward_that_keeps_the_graph_runs_twice_on_intact_saved_tensors(cache):
    """`backward(retain_graph=True)` then `backward()`: each gets the saved activations as the forward left them, with
    the cache on (the backward compiled with the forward, donating) or off, and after a step that donated them."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    executor = Overwrites()
    cf = pipeline.jit(sin_mm_tanh_mm, executors=[executor], cache=cache)
    if not cache:  # a plain step first: the backward compiles donating, as with the cache on
        cf(x, w).backward()
        sin_mm_tanh_mm(x2, w2).backward()
    _step_twice_keeping_the_graph(cf, x, w)
    _step_twice_keeping_the_graph(sin_mm_tanh_mm, x2, w2)
    assert executor.overwritten, "no region overwrote a donated input: the test proves nothing"
    torch.testing.assert_close((x.grad, w.grad), (x2.grad, w2.grad))


def test_a_warm_start_keeps_the_graph_too():
    torch.manual_seed(0)
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    pipeline.jit(sin_mm_tanh_mm, executors=[Overwrites()])(x, w).backward()
    torch._dynamo.reset()
    warm = pipeline.jit(sin_mm_tanh_mm, executors=[executor := Overwrites()])
    x.grad = w.grad = None
    _step_twice_keeping_the_graph(warm, x, w)
    assert pipeline.compile_stats(warm).cache == {"g0": "hit"} and executor.overwritten
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    _step_twice_keeping_the_graph(sin_mm_tanh_mm, x2, w2)
    torch.testing.assert_close((x.grad, w.grad), (x2.grad, w2.grad))


def test_a_backward_recorded_as_a_cuda_graph_refuses_to_keep_the_graph():
    """A recorded backward replays its writes into the saved activations: keeping the graph is refused, loudly."""
    from executors.donation import keeping_saved_tensors
    stage = keeping_saved_tensors(lambda args: [a * 2 for a in args], [0], recorded=True)

    class Calls(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return stage([grad])[0]
    x = torch.randn(3, requires_grad=True)
    Calls.apply(x).sum().backward()  # not kept: runs
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    with pytest.raises(RuntimeError, match="retain_graph=True.*CUDA graph.*cuda_graphs=False"):
        Calls.apply(x).sum().backward(retain_graph=True)


@pytest.mark.cuda
def test_keeping_the_graph_under_cuda_graphs_is_right_or_refused_on_the_gpu():
    """On the GPU with `cuda_graphs=True`: two backwards of one graph give eager's gradients, or the first one raises
    the refusal above (a recorded backward that overwrites its saved activations); never other gradients."""
    x, w = (torch.randn(64, 64, device="cuda", requires_grad=True) for _ in range(2))
    cf = pipeline.jit(sin_mm_tanh_mm, executors=["inductor"], cuda_graphs=True)
    for _ in range(3):
        x.grad = w.grad = None
        try:
            _step_twice_keeping_the_graph(cf, x, w)
        except RuntimeError as e:
            assert re.search("retain_graph=True.*CUDA graph.*cuda_graphs=False", str(e)), e
            return
        x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        _step_twice_keeping_the_graph(sin_mm_tanh_mm, x2, w2)
        torch.testing.assert_close((x.grad, w.grad), (x2.grad, w2.grad))
    assert pipeline.compile_stats(cf).cuda_graphs.get("g0 backward") == "on"
