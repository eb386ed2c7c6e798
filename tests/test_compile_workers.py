"""Regions compiled in worker processes (executors/compile_workers.py): each distinct region is
compiled once in a worker, loaded here like a cached artifact, and matches eager; whatever a worker
cannot do is compiled in this process instead. Uses a cheap test executor, not Inductor (whose CPU
regions stay in-process: a new worker first probes the vector ISA, ~20 s)."""
import os
import pickle

import pytest
import torch

import pipeline
from executors import Executor
from executors.base import Cacheable
from helpers import assert_same_grads


class InWorkers(Cacheable):
    """A fusion executor for the elementwise ops of a small MLP whose regions compile in 2 workers;
    its artifact records the pid that compiled it (`fail_in_workers`: a worker's compile raises)."""
    name, kind, compile_workers = "spread", "fusion", 2
    ops = {torch.ops.aten.relu.default, torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor,
           torch.ops.aten.threshold_backward.default}

    def __init__(self, fail_in_workers=False):
        self.fail_in_workers = fail_in_workers
        self.loaded_from = []  # pids that compiled what this process loaded

    def claims_op(self, op, node):
        return op in self.ops

    def compile_region(self, gm, example_inputs):
        if self.fail_in_workers and os.getpid() != self.parent:
            raise RuntimeError("this worker cannot compile")
        return gm.forward

    def for_model(self):
        self.parent = os.getpid()
        return self

    def save_region(self, fn):
        from ir import trace_pickle
        return pickle.dumps((os.getpid(), trace_pickle.dumps(fn.__self__)))

    def load_region(self, data, gm, example_inputs):
        from ir import trace_pickle
        pid, graph = pickle.loads(data)
        self.loaded_from.append(pid)
        loaded = trace_pickle.loads(graph)
        loaded.recompile()
        return loaded.forward


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x)) * 2 + 1
        return x


def _train_step(ex):
    torch.manual_seed(0)
    eager = Net()
    cm = pipeline.jit(Net(), executors=[ex, "torch"])
    cm.load_state_dict(eager.state_dict())
    x = torch.randn(4, 8)
    out = cm(x)
    torch.testing.assert_close(out, eager(x))
    out.sum().backward()
    eager(x).sum().backward()
    assert_same_grads(eager, cm)
    return cm


def test_regions_compile_in_workers_and_train_like_eager(monkeypatch):
    monkeypatch.setenv("PIPELINE_CACHE", "0")
    ex = InWorkers()
    cm = _train_step(ex)
    regions = [r for r in pipeline.regions(cm) if r.executor == "spread"]
    assert {r.stage for r in regions} == {"forward", "backward"}
    # one region of each kind is compiled (three identical layers run one region's code), each in a worker
    assert len(ex.loaded_from) == len({r.compiled_as or r.id for r in regions}) >= 2
    assert os.getpid() not in ex.loaded_from
    stats = pipeline.compile_stats(cm)
    assert all(r.compiled_in_worker for r in regions if r.compiled_as is None)
    assert stats.seconds["compile:spread (in workers)"] > 0 and not stats.fallbacks


def test_a_region_a_worker_cannot_compile_is_compiled_here(monkeypatch):
    monkeypatch.setenv("PIPELINE_CACHE", "0")
    ex = InWorkers(fail_in_workers=True)
    cm = _train_step(ex)
    assert ex.loaded_from == []  # nothing came from a worker
    assert {r.executor for r in pipeline.regions(cm)} >= {"spread"}  # compiled here instead
    assert not pipeline.compile_stats(cm).fallbacks


def test_worker_artifacts_are_stored_in_the_cache_and_loaded_warm():
    cold = InWorkers()
    _train_step(cold)
    assert cold.loaded_from and os.getpid() not in cold.loaded_from
    torch._dynamo.reset()
    warm = InWorkers()
    cm = _train_step(warm)
    assert sorted(warm.loaded_from) == sorted(cold.loaded_from)  # the workers' artifacts, from the cache
    assert pipeline.compile_stats(cm).cache_hits == 1


def test_worker_settings_must_match():
    """A worker whose executor settings come out different (its cache token) refuses the region."""
    from executors import compile_workers
    ex = InWorkers()
    job = pickle.dumps((ex, "another token", compile_workers._settings()))
    with pytest.raises(RuntimeError, match="settings differ"):
        compile_workers._compile(job, b"")
