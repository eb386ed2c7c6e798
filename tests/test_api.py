"""pipeline.jit's contract: clear errors for misuse, module behaviour, inspection."""
import warnings

import pytest
import torch

import pipeline
from ir import PipelineFallbackWarning
from executors import Executor


def test_unknown_executor_name_is_an_error_naming_it(mlp):
    with pytest.raises(ValueError, match="unknown executor 'tensorrt'.*known executors"):
        pipeline.jit(mlp, executors=["tensorrt"])


def test_non_callable_model_is_an_error():
    with pytest.raises(TypeError, match="nn.Module or a function, got int"):
        pipeline.jit(42)


@pytest.mark.parametrize("kwargs, match", [
    (dict(executors="torch"), "executors must be a list"),
    (dict(executors=[object()]), "not an executor"),
    (dict(executors=[]), "executors is empty"),
    (dict(executors=["torch", "torch"]), "listed twice"),
    (dict(fullgraph="yes"), "fullgraph must be True or False"),
    (dict(dynamic="sometimes"), "dynamic must be None, True or False"),
    (dict(transforms=[3]), "transforms must hold trace passes"),
    (dict(cuda_graphs="yes"), "cuda_graphs must be True or False"),
])
def test_bad_options_are_errors_naming_them(mlp, kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        pipeline.jit(mlp, **kwargs)


def test_unknown_option_is_an_error(mlp):
    with pytest.raises(TypeError, match="unexpected keyword argument 'backend'"):
        pipeline.jit(mlp, backend="inductor")


class Missing(Executor):
    name, kind = "missing", "fusion"

    def unavailable_reason(self):
        return "the missing library is not installed (pip install missing)"


def test_available_is_falsy_with_the_reason_when_the_executor_cannot_run():
    """`if executors.nvfuser.available():` is false on a machine without nvFuser (not a truthy tuple)."""
    import executors
    missing, here = Missing().available(), executors.torch.available()
    assert not missing and missing.reason == "the missing library is not installed (pip install missing)"
    assert here and here.reason is None
    for ex in (executors.nvfuser, executors.te):
        assert bool(ex.available()) == (ex.unavailable_reason() is None)
        assert ex.available().reason == ex.unavailable_reason()


def test_only_unavailable_executors_is_an_error_naming_each(mlp):
    with pytest.raises(RuntimeError, match="missing: the missing library is not installed"):
        pipeline.jit(mlp, executors=[Missing()])


@pytest.mark.allow_fallback
def test_unavailable_executor_is_a_loud_fallback(mlp):
    """A listed executor missing here is skipped as a fallback: one PipelineFallbackWarning, a line in
    compile_stats, and an error under fallback="raise" (a run that asked for nvFuser says it had none)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm = pipeline.jit(mlp, executors=[Missing(), "torch"])
    assert [(w.category, str(w.message)) for w in caught if "missing" in str(w.message)] == [
        (PipelineFallbackWarning, "pipeline: executor 'missing' is not available and is skipped: the missing "
         "library is not installed (pip install missing)")]
    cm(torch.randn(2, 16))
    assert {r.executor for r in pipeline.regions(cm)} == {"torch"}
    assert [f for f in pipeline.compile_stats(cm).fallbacks if "'missing'" in f] == [
        "executor 'missing' is not available and is skipped: the missing library is not installed (pip install missing)"]
    with pytest.raises(pipeline.PipelineFallbackError, match="executor 'missing' is not available"):
        pipeline.jit(mlp, executors=[Missing(), "torch"], fallback="raise")


def test_executor_names_import_as_objects():
    from executors import inductor, torch as torch_ex
    assert isinstance(inductor, Executor) and inductor.name == "inductor"
    assert isinstance(torch_ex, Executor) and torch_ex.name == "torch"
    import executors.inductor_executor  # importing a submodule does not shadow the object
    assert isinstance(executors.inductor, Executor)


def test_jitted_module_behaves_like_the_module(mlp):
    cm = pipeline.jit(mlp, executors=["torch"])
    assert [id(p) for p in cm.parameters()] == [id(p) for p in mlp.parameters()]
    assert cm.state_dict().keys() == mlp.state_dict().keys()
    cm.eval()
    assert not mlp.training and not cm.training
    cm.train()
    assert mlp.training
    sd = {k: torch.zeros_like(v) for k, v in mlp.state_dict().items()}
    cm.load_state_dict(sd)
    assert torch.equal(mlp.fc1.weight, torch.zeros_like(mlp.fc1.weight))
    assert cm.fc1 is mlp.fc1


def test_attributes_set_on_the_jitted_module_reach_the_compiled_model():
    """`cm.scale = 3.0` stayed on the wrapper while the compiled code read the original's 1.0; a non-persistent buffer
    registered on the wrapper landed in its state dict."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.scale = torch.nn.Linear(3, 3), 1.0

        def forward(self, x):
            return self.fc(x) * self.scale

    model, x = Scaled(), torch.randn(2, 3)
    cm = pipeline.jit(model, executors=["torch"])
    cm(x)
    cm.scale = 3.0
    assert model.scale == 3.0
    torch.testing.assert_close(cm(x), model.fc(x) * 3.0)
    cm.register_buffer("scratch", torch.ones(2), persistent=False)
    assert "scratch" not in cm.state_dict() and model.scratch is cm.scratch
    del cm.scale
    assert not hasattr(model, "scale")
    cm.__dict__["own"] = 1  # a field of the wrapper's own is deleted from it
    del cm.own
    assert "own" not in cm.__dict__


def test_optimizer_on_jitted_parameters_trains_the_original(mlp):
    cm = pipeline.jit(mlp, executors=["torch"])
    opt = torch.optim.AdamW(cm.parameters(), lr=1e-2)
    before = mlp.fc1.weight.detach().clone()
    cm(torch.randn(4, 16)).pow(2).sum().backward()
    opt.step()
    assert not torch.equal(before, mlp.fc1.weight)


def test_fullgraph_graph_break_names_reason_and_line():
    def f(x):
        if x.sum() > 0:
            return x * 2
        return x
    cf = pipeline.jit(f, executors=["torch"], fullgraph=True)
    with pytest.raises(pipeline.GraphBreakError, match=r"Data-dependent branching at .*test_api.py:\d+"):
        cf(torch.ones(3))


def test_explain_lists_breaks_graphs_and_ops():
    def f(x):
        x = x.sin() + 1
        print("break")
        return x.cos()
    report = pipeline.explain(f, torch.randn(4))
    assert report.graphs == 2
    assert len(report.graph_breaks) == 1 and "test_api.py" in report.graph_breaks[0].where
    assert report.ops_per_graph == [2, 1]


def test_compile_stats_report_graphs_and_stage_times(mlp):
    cm = pipeline.jit(mlp, executors=["torch"])
    cm(torch.randn(2, 16))
    stats = pipeline.compile_stats(cm)
    assert stats.graphs == 1 and stats.graph_breaks == [] and stats.recompilations == 0
    for stage in ("capture", "lower", "dispatch"):
        assert stats.seconds[stage] > 0
    cm(torch.randn(2, 16, dtype=torch.float64).float())  # same metadata: no recompile
    assert pipeline.compile_stats(cm).graphs == 1


def test_compile_stats_add_up_to_the_first_step():
    """Every second of a first training step is somewhere in compile_stats (issue: time hid where no
    counter looked): capture, lowering, dispatch, compiles, and each stage's first call (kernels
    loaded on first launch, warm-ups), which is not capture."""
    import time
    from models import LanguageModelLoss, Llama, LlamaConfig
    config = LlamaConfig(vocab=128, dim=64, layers=2, heads=4, kv_heads=2, hidden=176, max_seq=32)
    cm = pipeline.jit(LanguageModelLoss(Llama(config)), executors=["torch"])
    tokens = torch.randint(0, 128, (2, 32))
    start = time.perf_counter()
    cm(tokens).backward()
    wall = time.perf_counter() - start
    seconds = pipeline.compile_stats(cm).seconds
    assert seconds["first call (forward)"] > 0 and seconds["first call (backward)"] > 0, seconds
    assert 0.9 * wall <= sum(seconds.values()) <= 1.02 * wall, (wall, seconds)


def test_cuda_graphs_off_the_gpu_run_as_usual_and_say_why(mlp):
    cm = pipeline.jit(mlp, executors=["torch"], cuda_graphs=True)
    x = torch.randn(2, 16, requires_grad=True)
    out = cm(x)
    torch.testing.assert_close(out, mlp(x))
    out.sum().backward()
    stats = pipeline.compile_stats(cm)
    assert set(stats.cuda_graphs) == {"g0 forward", "g0 backward"}
    assert all(v.startswith("off: ") for v in stats.cuda_graphs.values()), stats.cuda_graphs
    assert "CUDA graph off: " in str(stats)


def test_recompilation_is_counted(mlp):
    cm = pipeline.jit(mlp.double(), executors=["torch"], dynamic=False)
    cm(torch.randn(2, 16, dtype=torch.float64))
    cm(torch.randn(3, 16, dtype=torch.float64))
    assert pipeline.compile_stats(cm).recompilations == 1


def test_region_table_prints_every_region(mlp):
    cm = pipeline.jit(mlp, executors=["torch"])
    with torch.no_grad():
        cm(torch.randn(2, 16))
    table = pipeline.regions(cm)
    assert len(table) == 1 and table[0].executor == "torch" and table[0].stage == "inference"
    assert sorted(table[0].ops) == ["addmm", "addmm", "gelu", "t", "t"]
    assert "f32[2, 16]" in table[0].input_shapes and table[0].output_shapes == ["f32[2, 8]"]
    text = str(table)
    assert "executor" in text and "addmm×2" in text and "inference" in text


def test_inspection_of_a_plain_module_is_an_error(mlp):
    with pytest.raises(TypeError, match="returned by pipeline.jit"):
        pipeline.regions(mlp)


@pytest.mark.allow_fallback
def test_lowering_failure_runs_the_graph_in_eager_with_the_reason(mlp, monkeypatch):
    import pipeline.compiler as compiler

    def broken(*args, **kwargs):
        raise NotImplementedError("no lowering for this construct")
    monkeypatch.setattr(compiler, "aot_module_simplified", broken)
    cm = pipeline.jit(mlp, executors=["torch"])
    x = torch.randn(2, 16)
    with pytest.warns(PipelineFallbackWarning, match="runs in eager"):
        out = cm(x)
    assert torch.equal(out, mlp(x))
    stats = pipeline.compile_stats(cm)
    assert "no lowering for this construct" in stats.eager_fallbacks["g0"]
    assert len(stats.fallbacks) == 1 and "no lowering for this construct" in stats.fallbacks[0]


def test_lowering_failure_is_an_error_under_fallback_raise(mlp, monkeypatch):
    import pipeline.compiler as compiler

    def broken(*args, **kwargs):
        raise NotImplementedError("no lowering for this construct")
    monkeypatch.setattr(compiler, "aot_module_simplified", broken)
    cm = pipeline.jit(mlp, executors=["torch"], fallback="raise")
    with pytest.raises(pipeline.PipelineFallbackError, match="g0 runs in eager.*no lowering for this construct"):
        cm(torch.randn(2, 16))


def test_profile_times_every_region_by_name(mlp, tmp_path):
    import json
    cm = pipeline.jit(mlp, executors=["torch"])
    table = pipeline.profile(cm, torch.randn(4, 16), chrome_trace=str(tmp_path / "trace.json"))
    assert [(r.stage, r.executor, r.calls) for r in table] == [("forward", "torch", 1), ("backward", "torch", 1)]
    assert all(r.ms > 0 for r in table)
    names = {e.get("name") for e in json.load(open(tmp_path / "trace.json"))["traceEvents"]}
    assert {"region0:torch", "region1:torch"} <= names
    assert "total in regions" in str(table)


@pytest.mark.allow_fallback
def test_gpu_executors_without_their_libraries_say_what_is_missing(mlp):
    import executors
    for name in ("nvfuser", "te"):
        if getattr(executors, name).available():
            continue
        with pytest.raises(RuntimeError, match=f"{name}: "):
            pipeline.jit(mlp, executors=[name])
        with pytest.warns(PipelineFallbackWarning, match=f"executor '{name}' is not available"):
            pipeline.jit(mlp, executors=[name, "torch"])


def test_compiled_stages_free_each_input_after_its_last_use():
    import gc
    import weakref

    import torch.fx as fx
    from pipeline.boxed import boxed

    a = torch.randn(4)
    ref, seen = weakref.ref(a), []

    def probe(x):
        gc.collect()
        seen.append(ref() is None)
        return x

    g = fx.Graph()
    pa, pb = g.placeholder("a"), g.placeholder("b")
    y = g.call_function(torch.add, (g.call_function(torch.sin, (pa,)), pb))
    g.output((g.call_function(probe, (y,)),))
    run = boxed(fx.GraphModule({}, g))
    args = [a, torch.randn(4)]
    del a
    run(args)
    assert args == [] and seen == [True]  # `a` was freed before the stage returned


def test_compiling_freezes_older_objects_for_the_gc_and_releases_them(mlp, monkeypatch):
    """While the first call captures (Dynamo) and compiles, and while each stage first runs, garbage
    collections skip the objects that existed before (`gc.freeze`); afterwards nothing stays frozen, later
    calls freeze nothing, and objects the program froze itself stay frozen."""
    import gc
    monkeypatch.setenv("PIPELINE_CACHE", "0")  # the cache records a backward at once; without it, lazily
    seen, freezes, counted = [], [], []
    real_freeze, real_unfreeze, real_count = gc.freeze, gc.unfreeze, gc.get_freeze_count
    monkeypatch.setattr(gc, "freeze", lambda: (freezes.append(1), real_freeze()))
    monkeypatch.setattr(gc, "get_freeze_count", lambda: (counted.append(1), real_count())[1])

    def collecting(phase, info):  # each collection: whether the older objects are frozen
        if phase == "start":
            seen.append(real_count() > 0)

    def step(fn):
        seen.clear()
        fn(torch.randn(4, 16)).sum().backward()
        gc.collect(0)  # one collection after the step, whatever the step's own allocations triggered
        return seen[:-1], seen[-1]
    fn = pipeline.jit(mlp, executors=["torch"])
    gc.callbacks.append(collecting)
    try:
        during, after = step(fn)  # capture, forward compile, backward compile (lazy) and first runs
        assert during and all(during) and not after and real_count() == 0
        assert len(counted) == 3  # one O(heap) count per outermost block: the call, the backward compile, its first run
        freezes.clear()
        during, after = step(fn)
        assert not freezes and not any(during) and not after  # a step that compiles nothing freezes nothing
        torch._dynamo.reset()
        real_freeze()  # the program's own
        try:
            freezes.clear()
            pipeline.jit(mlp, executors=["torch"])(torch.randn(4, 16))
            assert not freezes and real_count() > 0  # neither frozen again nor released by the pipeline
        finally:
            real_unfreeze()
    finally:
        gc.callbacks.remove(collecting)


def test_objects_python_parks_among_the_frozen_do_not_turn_the_freeze_off(mlp, monkeypatch):
    """Python 3.12 parks its immortal objects (~400) among the frozen ones at each full collection: not the
    program's own freeze, so a first call after one still freezes (it had not, on the GPU machine's Python 3.12)
    and releases everything after. A program's own `gc.freeze()` (its whole heap) is kept: nothing frozen or released."""
    import gc
    from pipeline import compiler
    monkeypatch.setenv("PIPELINE_CACHE", "0")
    frozen_in_capture = []
    real_freeze, real_count = gc.freeze, gc.get_freeze_count
    monkeypatch.setattr(gc, "freeze", lambda: (frozen_in_capture.append(compiler._gc_frozen[0]), real_freeze()))
    real_freeze()  # the program's own
    try:
        pipeline.jit(mlp, executors=["torch"])(torch.randn(4, 16))
        assert not frozen_in_capture and real_count() >= compiler.PYTHONS_OWN_FROZEN
    finally:
        gc.unfreeze()
    torch._dynamo.reset()
    gc.collect()  # Python 3.12 parks its immortal objects here; 3.11 and 3.13 none
    parked = real_count()
    monkeypatch.setattr(gc, "get_freeze_count", lambda: real_count() - parked + 400)  # 3.12's case on any Python
    pipeline.jit(mlp, executors=["torch"])(torch.randn(4, 16))
    assert frozen_in_capture and frozen_in_capture[0] is False  # the outermost block froze
    assert real_count() < compiler.PYTHONS_OWN_FROZEN  # and released it all


def test_lowering_renders_graphs_as_text_only_when_a_log_asks(mlp, monkeypatch):
    """AOTAutograd prints the joint, forward and backward graphs for its logs even when none is on
    (~5% of lowering): skipped then; with `TORCH_LOGS=aot_graphs` (here `set_logs`) they are printed."""
    monkeypatch.setenv("PIPELINE_CACHE", "0")  # both compiles lower (a hit would not)
    rendered = []
    real = torch.fx.GraphModule.print_readable
    monkeypatch.setattr(torch.fx.GraphModule, "print_readable",
                        lambda self, *a, **k: (rendered.append(1), real(self, *a, **k))[1])
    x = torch.randn(4, 16)
    cm = pipeline.jit(mlp, executors=["torch"])
    cm(x).sum().backward()
    assert rendered == [] and pipeline.regions(cm)  # lowered, compiled, and nothing rendered
    torch._dynamo.reset()
    torch._logging.set_logs(aot_graphs=True)
    try:
        pipeline.jit(mlp, executors=["torch"])(x).sum().backward()
    finally:
        torch._logging.set_logs()
    assert len(rendered) >= 3  # joint, forward, backward
