"""`pipeline.jit(..., autotune=True)` at its edges: wrong candidates, captures, failed compiles, the
cache it writes to and what compile_stats count (each was a bug found in review)."""
import os
import time
import types

import pytest
import torch
from torch import nn

import pipeline
from executors import autotune
from executors.base import Cacheable
from pipeline.cache import save_changed

aten = torch.ops.aten


class Timed(Cacheable):
    """Runs a region's ATen graph, sleeping in regions holding one of `slow_on`; `wrong=True`
    returns float64 outputs (a wrong result the region check catches); `broken=True` fails to compile."""
    kind = "fusion"

    def __init__(self, name, slow_on=(), seconds=0.005, wrong=False, broken=False, storable=True):
        self.name, self.slow_on, self.seconds = name, set(slow_on), seconds
        self.wrong, self.broken, self.storable = wrong, broken, storable

    def claims_op(self, op, node):
        return "sin" not in str(op)

    def compile_region(self, gm, example_inputs):
        if self.broken:
            raise RuntimeError("out of memory (transient)")
        slow = any(n.target in self.slow_on for n in gm.graph.nodes)

        def run(*args):
            if slow:
                time.sleep(self.seconds)
            out = gm(*args)
            return [o.double() for o in out] if self.wrong else out
        return run

    def cache_token(self):
        return f"timed {self.name} {sorted(map(str, self.slow_on))} {self.wrong}"

    def artifact_unsupported_reason(self, gm, example_inputs):
        return None if self.storable else "timed: cannot store this region"

    def save_region(self, fn):
        return b""

    def load_region(self, data, gm, example_inputs):
        return self.compile_region(gm, example_inputs)


EVERY_OP = {aten.mm.default, aten.addmm.default, aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor,
            aten.add.Scalar}


def f(x):
    return torch.sin(x * 3.0) + 2.0


def test_the_race_never_chooses_a_candidate_whose_result_is_wrong():
    """A fast candidate returning a wrong result (float64 for float32) is checked as the region's
    first call is and left out of the race, so the right one runs it, with no fallback."""
    good, bad = Timed("good", EVERY_OP), Timed("bad", wrong=True)
    cm = pipeline.jit(f, executors=[good, bad], autotune=True)
    x = torch.randn(8)
    torch.testing.assert_close(cm(x), f(x))
    raced = [r for r in pipeline.regions(cm) if r.race]
    assert raced and all(r.executor == "good" for r in raced), str(pipeline.regions(cm))


def test_a_wrong_candidate_in_the_race_does_not_crash_the_first_training_step():
    """The same with donated inputs (a backward region reading saved activations last), where the
    region check could not run the call again: the wrong candidate never runs the region."""
    good, bad = Timed("good", EVERY_OP), Timed("bad", wrong=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    cm = pipeline.jit(model, executors=[good, bad], autotune=True)
    cm(torch.randn(4, 8)).sum().backward()
    assert all(r.executor == "good" for r in pipeline.regions(cm) if r.race), str(pipeline.regions(cm))


def test_a_choice_made_without_measuring_is_not_stored(monkeypatch):
    """Inside a CUDA-graph capture nothing is measured and the first listed runs; that is not stored
    as a choice, so the next process measures (the capture simulated by patching its check)."""
    class Capturing:
        cuda = types.SimpleNamespace(is_available=lambda: True, is_current_stream_capturing=lambda: True)

        def __getattr__(self, name):
            return getattr(torch, name)
    slow_first, fast = Timed("slow_first", EVERY_OP, 0.01), Timed("fast")
    with monkeypatch.context() as patched, torch.no_grad():
        patched.setattr(autotune, "torch", Capturing())
        pipeline.jit(f, executors=[slow_first, fast], autotune=True)(torch.randn(8))
    torch._dynamo.reset()
    warm = pipeline.jit(f, executors=[Timed("slow_first", EVERY_OP, 0.01), Timed("fast")], autotune=True)
    with torch.no_grad():
        warm(torch.randn(8))
    raced = [r for r in pipeline.regions(warm) if r.race is not None]
    assert raced and all(r.executor == "fast" for r in raced), str(pipeline.regions(warm))


def test_a_choice_is_written_to_the_cache_it_was_read_from(tmp_path, monkeypatch):
    """A backward's choice is made after the jitted call returned and written later (`save_changed`):
    into the cache folder its entry came from, even if `PIPELINE_CACHE_DIR` changed since."""
    first, second = tmp_path / "first", tmp_path / "second"
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(first))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    cm = pipeline.jit(model, executors=[Timed("a", {aten.mul.Tensor}), Timed("b", {aten.add.Tensor})],
                      autotune=True)
    cm(torch.randn(4, 8)).sum().backward()  # the backward's race decides now, after the call
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(second))
    save_changed()  # what the next autotuned call (of any model) or exit does
    written = [name for _, _, names in os.walk(second) for name in names if name.endswith(".entry")]
    assert not written, f"entries of {first} written under {second}: {written}"


def test_compile_stats_count_the_other_candidates_compile_once():
    """Compiling the other candidates is counted once (`autotune`, inside the backend's time), so
    capture stays positive and the seconds add up to the first call within 10%."""
    class SlowCompile(Timed):
        def compile_region(self, gm, example_inputs):
            time.sleep(0.3)
            return super().compile_region(gm, example_inputs)
    cm = pipeline.jit(f, executors=[Timed("a"), SlowCompile("b")], autotune=True, cache=False)
    start = time.perf_counter()
    with torch.no_grad():
        cm(torch.randn(8))
    wall = time.perf_counter() - start
    seconds = pipeline.compile_stats(cm).seconds
    assert seconds["autotune"] > 0.5  # two regions' second candidate, 0.3 s each
    assert seconds["capture"] >= 0 and 0.9 * wall <= sum(seconds.values()) <= 1.02 * wall, (wall, seconds)


@pytest.mark.allow_fallback
def test_a_race_after_a_failed_compile_is_not_stored():
    """A region an executor failed to compile is not cached (the compile may succeed next time), raced
    or not: after a transient failure of the first listed, the next process tries it again."""
    def run(broken):
        torch._dynamo.reset()
        listed = [Timed("first", broken=broken), Timed("second", EVERY_OP), Timed("third", EVERY_OP)]
        cm = pipeline.jit(f, executors=listed, autotune=True)
        with torch.no_grad():
            cm(torch.randn(8))
        return cm
    with pytest.warns(Warning):  # the failed compile is reported as a fallback
        run(broken=True)
    warm = run(broken=False)
    assert {r.executor for r in pipeline.regions(warm) if "sin" not in r.ops} == {"first"}, \
        str(pipeline.regions(warm))


@pytest.mark.parametrize("woke_early", ["once", "always"])
def test_a_gpu_run_the_sleep_did_not_cover_is_timed_again_with_a_longer_sleep(monkeypatch, woke_early):
    """On a GPU each timed run's launches queue behind a sleep; a run whose sleep ended before the
    host finished launching timed the launching too, so it is run again with a 4x longer sleep
    (3 times at most: a region that waits for the GPU always wakes it early). CUDA faked: the logic."""
    sleeps = []

    class FakeEvent:
        def __init__(self, enable_timing):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def query(self):  # the begin event: done (the GPU awake) before the launching ended?
            return woke_early == "always" or sleeps[-1] == sleeps[0]

        def elapsed_time(self, other):
            return 1.0
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", sleeps.append)
    ms, _ = autotune._median_ms(lambda x: x + 1, [torch.ones(2)], [], True, lambda out: None)
    assert ms == 1.0
    longer = 1 if woke_early == "once" else 3
    assert len(sleeps) == autotune.RUNS + longer
    assert sleeps[:longer + 1] == [sleeps[0] * 4 ** k for k in range(longer + 1)]


def test_a_cpu_region_is_wall_timed_in_a_process_that_uses_cuda(monkeypatch):
    """Whether CUDA is in use in the process does not decide how a region is timed: one whose inputs
    are on the CPU is timed by the wall clock (GPU events around it would time an idle GPU: ~0 ms for
    every candidate, and the first listed always kept). CUDA faked as initialised; its events raise."""
    from ir import Region
    gm = torch.fx.symbolic_trace(lambda x: (x + 1,))
    slow, fast = Timed("slow"), Timed("fast")
    chosen = []
    race = autotune.Race([(slow, lambda x: (time.sleep(0.005), (x + 1,))[1]), (fast, lambda x: (x + 1,))],
                         Region(0, "forward", "slow", ["add"], [], []), gm,
                         lambda name, times, seconds: chosen.append((name, times)), lambda out: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", None)  # calling it raises: no GPU timing of a CPU region
    torch.testing.assert_close(race(torch.ones(4)), (torch.full((4,), 2.0),))
    [(name, times)] = chosen
    assert name == "fast" and times["slow"] > 4 > times["fast"], times
