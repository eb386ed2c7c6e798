"""A cache hit starts warm: AOTAutograd's own entry, kept in ours, is loaded instead of lowering
again (`pipeline/warm_start.py`); whatever cannot take that path still compiles, saying why."""
import copy

import torch
import torch.nn as nn

import pipeline
from pipeline import warm_start
from test_cache import assert_identical, compile_and_step


def notes(cm):
    return [n for _, n in pipeline.compile_stats(cm).cache_notes]


def stages(cm):
    return [t.stage.value for t in pipeline.last_traces(cm)]


def test_a_hit_loads_without_lowering_and_is_bit_identical(mlp):
    x = torch.randn(4, 16)
    eager = copy.deepcopy(mlp)
    cold, out0, grads0 = compile_and_step(mlp, x)
    warm, out1, grads1 = compile_and_step(mlp, x)
    assert "joint" in stages(cold) and "lower" in pipeline.compile_stats(cold).seconds
    stats = pipeline.compile_stats(warm)
    assert stats.cache == {"g0": "hit"} and "lower" not in stats.seconds
    assert stages(warm) == ["captured", "forward", "forward", "backward", "backward"]  # no joint: nothing traced
    assert {r.executor for r in pipeline.regions(warm)} == {"torch"}
    assert torch.equal(out0, out1)
    assert_identical(grads0, grads1)
    eager(x).sum().backward()
    assert_identical(grads1, [p.grad for p in eager.parameters()])


def test_an_entry_that_does_not_load_compiles_with_the_reason(mlp, monkeypatch):
    x = torch.randn(4, 16)
    _, out0, grads0 = compile_and_step(mlp, x)

    def stale(data, loader):
        raise RuntimeError("entry from another torch")
    monkeypatch.setattr(warm_start, "load_entry", stale)
    warm, out1, grads1 = compile_and_step(mlp, x)
    assert "lower" in pipeline.compile_stats(warm).seconds
    assert any("warm start failed (RuntimeError: entry from another torch)" in n for n in notes(warm))
    assert torch.equal(out0, out1)
    assert_identical(grads0, grads1)


def test_a_graph_that_does_not_pickle_compiles_and_says_why():
    class Local(nn.Module):  # a class defined in a function: pickle cannot name it
        def forward(self, x):
            return x.sin() * 2
    model = nn.Sequential(nn.Linear(5, 4), Local())
    cm, _, _ = compile_and_step(model, torch.randn(3, 5))
    assert any(n.startswith("no warm start: the lowered graph does not pickle") for n in notes(cm)), notes(cm)


def test_symbolic_shapes_compile_without_a_warm_start(mlp):
    torch._dynamo.reset()
    cm = pipeline.jit(mlp, executors=["torch"], dynamic=True)
    cm(torch.randn(4, 16)).sum().backward()
    assert "no warm start: symbolic shapes" in notes(cm)


def test_a_graph_an_executor_prepared_starts_without_the_stored_entry(mlp):
    """An executor's `prepare` may bind this model's own state into the graph (TE's fp8 scaling
    handles): such a graph is lowered again on a hit, never loaded with another model's bindings."""
    from executors import Executor
    from executors.torch_executor import torch_executor

    class Preparing(Executor):
        name = "preparing"

        def claims_op(self, op, node):
            return torch_executor.claims_op(op, node)

        def compile_region(self, gm, example_inputs):
            return gm

        def prepare(self, trace):
            return trace.derive(trace.editable(), by="preparing.prepare"), []
    x = torch.randn(4, 16)
    for _ in range(2):
        cm, _, _ = compile_and_step(mlp, x, executors=[Preparing()])
        assert "lower" in pipeline.compile_stats(cm).seconds
        assert "no warm start: preparing.prepare rewrote the graph (its ops may name this model's own state)" in notes(cm)


class _Entry:
    def pre_save(self):
        self.saved = True


def test_only_the_outermost_aot_compile_is_stored_and_torch_is_restored():
    """An executor may run AOTAutograd inside ours: its entry is neither keyed nor kept as ours."""
    import pickle
    from types import SimpleNamespace

    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    original = (AOTAutogradCache.__dict__["try_load"], AOTAutogradCache.__dict__["save"])
    got, failures = [], []
    with warm_start.record_entry("ours", lambda data, seconds: got.append(data), failures.append):
        outer, inner = SimpleNamespace(cache_info=None), SimpleNamespace(cache_info=None)
        AOTAutogradCache.try_load(None, [], outer)
        AOTAutogradCache.try_load(None, [], inner)
        AOTAutogradCache.save("theirs", _Entry(), False)
        AOTAutogradCache.save("ours", _Entry(), False)
    assert outer.cache_info.cache_key == "ours" and inner.cache_info is None
    assert len(got) == 1 and pickle.loads(got[0]).saved and not failures
    assert (AOTAutogradCache.__dict__["try_load"], AOTAutogradCache.__dict__["save"]) == original


def test_torch_own_aot_cache_is_never_consulted(mlp, monkeypatch):
    """With our cache off (or a graph that cannot start warm), AOTAutograd must not look in torch's
    cache directory, which our trust checks do not cover."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

    def refuse(*args, **kwargs):
        raise AssertionError("torch's AOTAutogradCache was consulted")
    monkeypatch.setattr(AOTAutogradCache, "try_load", staticmethod(refuse))
    monkeypatch.setattr(AOTAutogradCache, "save", staticmethod(refuse))
    x = torch.randn(4, 16)
    eager = copy.deepcopy(mlp)
    for kwargs in ({"cache": False}, {"dynamic": True}):
        cm, out, grads = compile_and_step(mlp, x, **kwargs)
        assert {r.executor for r in pipeline.regions(cm)} == {"torch"}
        assert torch.equal(out, eager(x))
