"""`pipeline.jit(..., autotune=True)`: each kind of region runs on the listed executor measured
fastest at its first call; the times are in the region table, the choice in the cache."""
import copy
import time

import pytest
import torch
from torch import nn

import pipeline
from executors.autotune import why_not_raced
from executors.base import Cacheable
from helpers import assert_same_grads

aten = torch.ops.aten


class Slow(Cacheable):
    """Runs a region's ATen graph as `torch` does, sleeping first in regions holding one of
    `slow_on` (a known cost); every call of its compiled code is counted, measuring included."""
    kind = "fusion"

    def __init__(self, name, slow_on, seconds=0.01):
        self.name, self.slow_on, self.seconds = name, set(slow_on), seconds
        self.calls = 0

    def claims_op(self, op, node):
        return "sin" not in str(op)  # sin runs on the fallback: it splits the graph in regions

    def compile_region(self, gm, example_inputs):
        slow = any(n.target in self.slow_on for n in gm.graph.nodes)

        def run(*args):
            self.calls += 1
            if slow:
                time.sleep(self.seconds)
            return gm(*args)
        return run

    def cache_token(self):
        return f"slow {self.name} {sorted(map(str, self.slow_on))}"

    def save_region(self, fn):
        return b""

    def load_region(self, data, gm, example_inputs):
        return self.compile_region(gm, example_inputs)


class TwoParts(nn.Module):
    """A mul region and an add region, split by sin (which neither test executor claims)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return torch.sin(x @ self.w * 3.0) + 2.0


def test_each_region_runs_on_the_executor_measured_fastest():
    mul_slow = Slow("mul_slow", {aten.mul.Tensor, aten.mul.Scalar})
    add_slow = Slow("add_slow", {aten.add.Tensor, aten.add.Scalar})
    model, x = TwoParts(), torch.randn(4, 8)
    cm = pipeline.jit(model, executors=[mul_slow, add_slow], autotune=True)
    with torch.no_grad():
        torch.testing.assert_close(cm(x), model(x), rtol=0, atol=0)
    table = pipeline.regions(cm)
    by_op = {("mul" if any("mul" in o for o in r.ops) else "add" if any("add" in o for o in r.ops) else "other"): r
             for r in table}
    assert by_op["mul"].executor == "add_slow" and by_op["add"].executor == "mul_slow", str(table)
    for r in (by_op["mul"], by_op["add"]):
        assert set(r.race) == {"mul_slow", "add_slow"}
        assert r.race[r.executor] < 5 and max(r.race.values()) >= 10  # ms: the sleep is 10
    assert "autotuned: mul_slow" in str(table) and "(chosen)" in str(table)
    seconds = pipeline.compile_stats(cm).seconds  # compiling the other candidates, then measuring
    assert seconds["autotune"] >= 0 and seconds["autotune (measuring)"] > 0.02


def test_without_autotune_the_first_listed_runs_everything():
    mul_slow, add_slow = Slow("mul_slow", {aten.mul.Tensor}), Slow("add_slow", {aten.add.Tensor})
    cm = pipeline.jit(TwoParts(), executors=[mul_slow, add_slow])
    with torch.no_grad():
        cm(torch.randn(4, 8))
    assert {r.executor for r in pipeline.regions(cm)} == {"mul_slow", "torch"}
    assert all(r.race is None for r in pipeline.regions(cm)) and add_slow.calls == 0


def test_a_tie_within_noise_keeps_the_listed_order():
    every_op = {aten.mm.default, aten.mul.Tensor, aten.add.Tensor}
    first, second = Slow("first", every_op, 0.02), Slow("second", every_op, 0.02)
    cm = pipeline.jit(TwoParts(), executors=[first, second], autotune=True)
    with torch.no_grad():
        cm(torch.randn(4, 8))
    raced = [r for r in pipeline.regions(cm) if r.race]
    assert raced and all(r.executor == "first" for r in raced), str(pipeline.regions(cm))


def test_a_slow_candidate_with_noisy_runs_is_not_a_tie():
    """Listed first, a candidate whose runs take 10-50 ms (median 30, spread 20) against one of ~0 ms:
    its spread does not make it "within noise" of the fast one."""
    class Noisy(Slow):
        def compile_region(self, gm, example_inputs):
            sleeps = iter([0.01, 0.05, 0.01, 0.05, 0.03, 0.05, 0.03] * 10)

            def run(*args):
                self.calls += 1
                time.sleep(next(sleeps))
                return gm(*args)
            return run
    cm = pipeline.jit(TwoParts(), executors=[Noisy("noisy", ()), Slow("fast", ())], autotune=True)
    with torch.no_grad():
        cm(torch.randn(4, 8))
    raced = [r for r in pipeline.regions(cm) if r.race]
    assert raced and all(r.executor == "fast" for r in raced), str(pipeline.regions(cm))


def test_training_step_matches_eager_and_races_the_backward():
    mul_slow, add_slow = Slow("mul_slow", {aten.mul.Tensor}, 0.005), Slow("add_slow", {aten.add.Tensor}, 0.005)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    eager = copy.deepcopy(model)
    cm = pipeline.jit(model, executors=[mul_slow, add_slow], autotune=True)
    x = torch.randn(4, 8)
    cm(x).sum().backward()
    eager(x).sum().backward()
    assert_same_grads(eager, model, exact=False)
    stages = {r.stage for r in pipeline.regions(cm) if r.race}
    assert stages == {"forward", "backward"}, str(pipeline.regions(cm))


def test_identical_regions_are_measured_once():
    first, second = Slow("first", ()), Slow("second", {aten.mul.Tensor})

    class Repeated(nn.Module):
        def forward(self, x):
            for _ in range(4):
                x = torch.sin(x * 2.0)
            return x
    cm = pipeline.jit(Repeated(), executors=[second, first], autotune=True)
    cm(torch.randn(4, 8))
    table = pipeline.regions(cm)
    raced = [r for r in table if r.race]
    assert len(raced) == 4 and {r.executor for r in raced} == {"first"}
    assert sum(r.compiled_as is None for r in raced) == 1
    # one warm-up and five timed runs for each candidate, once; then 4 calls of the choice
    assert first.calls == 6 + 4 and second.calls == 6
    assert "(and 3 identical) autotuned" in str(table)


def test_a_warm_start_loads_the_choices_without_measuring():
    def run():
        mul_slow, add_slow = Slow("mul_slow", {aten.mul.Tensor}), Slow("add_slow", {aten.add.Tensor})
        torch._dynamo.reset()
        cm = pipeline.jit(TwoParts(), executors=[mul_slow, add_slow], autotune=True)
        with torch.no_grad():
            cm(torch.randn(4, 8))
        return cm, mul_slow, add_slow
    cold, *_ = run()
    cold_choice = {r.id: (r.executor, r.race) for r in pipeline.regions(cold)}
    warm, mul_slow, add_slow = run()
    assert pipeline.compile_stats(warm).cache == {"g0": "hit"}
    assert {r.id: (r.executor, r.race) for r in pipeline.regions(warm)} == cold_choice
    assert mul_slow.calls + add_slow.calls == 2  # each region ran once, on its choice: nothing measured
    assert pipeline.compile_stats(warm).seconds.get("autotune (measuring)", 0) == 0


def test_measuring_does_not_apply_an_input_mutation_twice():
    """Regions are functional (AOTAutograd writes mutated inputs back after the graph), so racing
    BatchNorm's region leaves its running statistics updated once."""
    first, second = Slow("first", ()), Slow("second", ())
    bn, x = nn.BatchNorm1d(8), torch.randn(4, 8)
    eager = copy.deepcopy(bn)
    cm = pipeline.jit(bn, executors=[first, second], autotune=True)
    torch.testing.assert_close(cm(x), eager(x))
    torch.testing.assert_close(bn.running_mean, eager.running_mean, rtol=0, atol=0)
    assert bn.num_batches_tracked.item() == 1
    assert any(r.race for r in pipeline.regions(cm))


def test_a_region_writing_into_its_inputs_is_never_raced():
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    g.output((g.call_function(aten.add_.Tensor, (a, b)),))
    assert "writes into its inputs (add__tensor)" in why_not_raced(torch.fx.GraphModule({}, g))
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    g.output((g.call_function(aten.add.Tensor, (a, b)),))
    assert why_not_raced(torch.fx.GraphModule({}, g)) is None


def test_random_regions_draw_the_same_numbers_as_without_autotune():
    """Measuring runs a region several times; the random state is put back, so dropout's mask is
    the one the unraced model draws."""
    def f(x):
        return torch.nn.functional.dropout(x * 2.0, 0.5, training=True) + 1.0
    x = torch.randn(64)
    outs = []
    for autotune in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(3)
        cm = pipeline.jit(f, executors=[Slow("first", ()), Slow("second", ())], autotune=autotune)
        outs.append((cm(x), torch.rand(1)))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_autotune_must_be_a_bool(bad):
    with pytest.raises(TypeError, match="autotune must be True or False"):
        pipeline.jit(nn.Linear(2, 2), autotune=bad)


class FailsToFinish(Slow):
    """A `Slow` whose compiles leave work running that fails when waited for (`finish_region`), as an
    Inductor kernel that does not compile would."""

    def finish_region(self, fn):
        raise RuntimeError("a kernel did not compile")


@pytest.mark.allow_fallback
def test_a_candidate_whose_compile_fails_when_finished_leaves_the_race():
    """Candidates are finished with the stage's other regions, before the first call measures them:
    one that fails there is not raced (the reason is in the region's table row); a region whose
    candidates all fail runs on the next executor, as after any failed compile."""
    model, x = TwoParts(), torch.randn(4, 8)
    failing, working = FailsToFinish("failing", set()), Slow("working", set())
    cm = pipeline.jit(model, executors=[failing, working], autotune=True)
    with pytest.warns(Warning, match="runs on working: failing failed to compile"), torch.no_grad():
        torch.testing.assert_close(cm(x), model(x), rtol=0, atol=0)
    raced = [r for r in pipeline.regions(cm) if r.executor != "torch"]
    assert raced and all(r.executor == "working" and set(r.race) == {"working"} for r in raced)
    assert all("failing failed to compile: RuntimeError: a kernel did not compile" in r.fallback_reason for r in raced)
    notes = [n for _, n in pipeline.compile_stats(cm).cache_notes]  # the choice is not stored: next time, all race
    assert any("not cached: an executor failed to compile it" in n for n in notes), notes
    torch._dynamo.reset()
    cm = pipeline.jit(model, executors=[failing, FailsToFinish("also_failing", set())], autotune=True)
    with pytest.warns(Warning, match="also_failing failed to compile"), torch.no_grad():
        torch.testing.assert_close(cm(x), model(x), rtol=0, atol=0)
    assert {r.executor for r in pipeline.regions(cm)} == {"torch"}
