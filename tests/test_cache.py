"""The compiled-artifact cache: hits give bit-identical results, corrupt entries recompile with one
warning, racing processes both succeed, and the cache can be turned off per model, by env, per pass."""
import copy
import glob
import json
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
import torch._dynamo

import pipeline
from pipeline.cache import read_entry, uncached
from pipeline.runtime_wrappers import ModelTransformInputs
from transforms import quantize, trace_pass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_step(cm, model, x):
    out = cm(x)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def compile_and_step(model, x, **kwargs):
    torch._dynamo.reset()
    cm = pipeline.jit(model, **{"executors": ["torch"], **kwargs})
    out, grads = train_step(cm, model, x)
    return cm, out, grads


def entries():
    return glob.glob(os.path.join(os.environ["PIPELINE_CACHE_DIR"], "*", "*.entry"))


def assert_identical(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_second_compile_hits_and_is_bit_identical(mlp):
    x = torch.randn(4, 16)
    cold, out0, grads0 = compile_and_step(mlp, x)
    warm, out1, grads1 = compile_and_step(mlp, x)
    assert pipeline.compile_stats(cold).cache == {"g0": "miss"}
    stats = pipeline.compile_stats(warm)
    assert stats.cache == {"g0": "hit"} and stats.cache_hits == 1 and stats.cache_misses == 0
    assert "cache load" in stats.seconds and not any(k.startswith("compile:") for k in stats.seconds)
    assert torch.equal(out0, out1)
    assert_identical(grads0, grads1)


@pytest.mark.parametrize("damage", ["truncate", "flip bytes"])
def test_corrupt_entry_recompiles_with_one_warning(mlp, damage):
    x = torch.randn(4, 16)
    _, out0, grads0 = compile_and_step(mlp, x)
    [path] = entries()
    data = bytearray(open(path, "rb").read())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-40:-30] = bytes(b ^ 0xFF for b in data[-40:-30])
    open(path, "wb").write(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm, out1, grads1 = compile_and_step(mlp, x)
    assert [str(w.message) for w in caught if "pipeline cache" in str(w.message)] == \
        [f"pipeline cache: entry {path} is not authentic (HMAC mismatch: corrupt, truncated, or not written by "
         f"you); not read; recompiling and replacing it"]
    assert pipeline.compile_stats(cm).cache == {"g0": "miss"}
    assert torch.equal(out0, out1)
    assert_identical(grads0, grads1)
    cm, _, _ = compile_and_step(mlp, x)  # the recompile replaced the entry
    assert pipeline.compile_stats(cm).cache == {"g0": "hit"}


RACER = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, "tests")
    import pipeline
    from conftest import MLP
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 16)
    cm = pipeline.jit(model, executors=["torch"])
    time.sleep(max(0.0, float(sys.argv[1]) - time.time()))  # both processes compile at once
    out = cm(x)
    out.sum().backward()
    print(pipeline.compile_stats(cm).cache["g0"], out.sum().item().hex())
""")


def test_two_processes_racing_to_fill_one_entry_both_succeed(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path / "cache"))
    env = dict(os.environ)
    start_at = str(time.time() + 8)  # after both have imported torch
    procs = [subprocess.Popen([sys.executable, "-c", RACER, start_at], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    outputs = [out.split()[-1] for out, _ in results]
    assert outputs[0] == outputs[1]
    [path] = entries()
    assert not glob.glob(str(tmp_path / "cache" / "*" / ".tmp-*"))
    assert read_entry(os.path.basename(path)[: -len(".entry")]) is not None


WARM = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, "tests")
    import pipeline
    from conftest import MLP
    torch.manual_seed(0)
    model, x = MLP().to(sys.argv[1]), torch.randn(4, 16, device=sys.argv[1])
    from executors.inductor_executor import InductorExecutor
    stored, save = [], InductorExecutor.save_region
    def recording_save(self, fn):  # how many Triton kernels each stored region bundles
        data = save(self, fn)
        bundle = getattr(fn.compiled, "_triton_bundle", None)
        stored.append(len(bundle.kernel_artifacts) if bundle is not None else 0)
        return data
    InductorExecutor.save_region = recording_save
    cm = pipeline.jit(model, executors=["inductor"])
    out = cm(x)
    out.sum().backward()
    stats = pipeline.compile_stats(cm)
    from torch._dynamo.utils import counters
    print(json.dumps({"cache": stats.cache, "notes": stats.cache_notes,
                      "bundled_kernels": counters["inductor"]["triton_bundler_load_static_autotuner"],
                      "stored_triton_kernels": sum(stored),
                      "compiled": [k for k in stats.seconds if k.startswith("compile:")],
                      "values": [t.detach().cpu().flatten().tolist() for t in [out, *(p.grad for p in model.parameters())]]}))
""")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_inductor_warm_process_with_empty_inductor_cache_is_bit_identical(tmp_path, device):
    """A second process finds the entry and loads Inductor's kernels from it, compiling nothing."""
    env = {**os.environ, "PIPELINE_CACHE_DIR": str(tmp_path / "cache"), "PIPELINE_LOG": "info"}
    runs, logs = [], []
    for name in ("cold", "warm"):
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / f"inductor-{name}")
        done = subprocess.run([sys.executable, "-c", WARM, device], cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=400)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        logs.append([line for line in done.stderr.splitlines() if "pipeline.cache" in line])
    cold, warm = runs
    assert cold["cache"] == {"g0": "miss"} and cold["compiled"] == ["compile:inductor"]
    assert warm["cache"] == {"g0": "hit"} and warm["compiled"] == [], (logs, warm["notes"])
    assert warm["values"] == cold["values"]  # float lists: equal means bit-identical (no NaNs here)
    if device == "cuda":  # Triton kernels launched from the artifact's bundle, not compiled from source
        assert warm["bundled_kernels"] > 0 and cold["bundled_kernels"] == 0, (warm, cold)
        assert cold["stored_triton_kernels"] > 0, cold  # bundled as the region waited, from where they compiled


def test_cache_off_by_option_or_env(mlp, monkeypatch):
    x = torch.randn(4, 16)
    cm, _, _ = compile_and_step(mlp, x, cache=False)
    assert pipeline.compile_stats(cm).cache == {"g0": "off: jit(..., cache=False)"}
    monkeypatch.setenv("PIPELINE_CACHE", "0")
    cm, _, _ = compile_and_step(mlp, x)
    assert pipeline.compile_stats(cm).cache == {"g0": "off: PIPELINE_CACHE=0"}
    assert entries() == []
    with pytest.raises(TypeError, match="cache must be True or False"):
        pipeline.jit(mlp, cache="yes")


def identity_pass(trace):
    return trace.derive(trace.editable(), by="identity")


def test_pass_that_opts_out_disables_the_cache_with_the_reason(mlp):
    opted_out = uncached(trace_pass(identity_pass))
    cm, _, _ = compile_and_step(mlp, torch.randn(4, 16), transforms=[opted_out])
    assert pipeline.compile_stats(cm).cache == {"g0": "off: pass 'identity_pass' opts out of caching"}
    assert entries() == []


def test_pass_without_readable_source_disables_the_cache(mlp):
    namespace = {}
    exec("def generated(trace):\n    return trace.derive(trace.editable(), by='generated')", namespace)
    cm, _, _ = compile_and_step(mlp, torch.randn(4, 16), transforms=[namespace["generated"]])
    status = pipeline.compile_stats(cm).cache["g0"]
    assert status.startswith("off: pass 'generated': the source of generated cannot be read")


def scaled_pass(factor):
    def scale_outputs(trace):
        gm = trace.editable()
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.aten.gelu.default:
                node.kwargs = {**node.kwargs, "approximate": "tanh" if factor > 1 else "none"}
        gm.recompile()
        return trace.derive(gm, by="scale_outputs")
    return trace_pass(scale_outputs)


def test_a_pass_closure_change_is_a_different_entry(mlp):
    x = torch.randn(4, 16)
    first, out_a, _ = compile_and_step(mlp, x, transforms=[scaled_pass(1)])
    second, out_b, _ = compile_and_step(mlp, x, transforms=[scaled_pass(2)])
    assert pipeline.compile_stats(second).cache == {"g0": "miss"}
    assert not torch.equal(out_a, out_b) and len(entries()) == 2


def test_a_change_to_the_pipeline_source_is_a_different_entry(mlp, monkeypatch):
    """Artifacts built by another version of the pipeline (how regions are formed, how an executor
    compiles them) are not loaded."""
    import pipeline.cache
    assert len(pipeline.cache.pipeline_source_hash()) == 64
    x = torch.randn(4, 16)
    compile_and_step(mlp, x)
    monkeypatch.setattr(pipeline.cache, "pipeline_source_hash", lambda: "another version")
    changed, _, _ = compile_and_step(mlp, x)
    assert pipeline.compile_stats(changed).cache == {"g0": "miss"} and len(entries()) == 2


def test_aot_autograd_config_is_in_the_key(mlp):
    """With `donated_buffer` on, a backward may overwrite its saved tensors (torch then refuses a second
    `backward(retain_graph=True)`); an entry compiled so must not load where it is off."""
    x = torch.randn(4, 16)
    compile_and_step(mlp, x)
    with torch._functorch.config.patch(donated_buffer=False):
        second, _, _ = compile_and_step(mlp, x)
    assert pipeline.compile_stats(second).cache == {"g0": "miss"} and len(entries()) == 2


class _Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _DoubledWrongly(_Doubled):  # the same forward; only the backward differs
    @staticmethod
    def backward(ctx, grad):
        return grad * 100


@pytest.mark.parametrize("first, second", [
    (lambda x: torch.utils.checkpoint.checkpoint(lambda y: y.sin() * 2, x, use_reentrant=False),
     lambda x: torch.utils.checkpoint.checkpoint(lambda y: y.cos() * 2, x, use_reentrant=False)),
    (lambda x: _Doubled.apply(x), lambda x: _DoubledWrongly.apply(x)),
], ids=["checkpoint body", "autograd.Function backward"])
def test_graphs_differing_only_inside_a_higher_order_op_are_different_entries(first, second):
    """The top graph's code only names a higher-order op's body (a submodule): the key hashes the bodies."""
    for fn in (first, second):
        torch._dynamo.reset()
        x, ref = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
        cm = pipeline.jit(fn, executors=["torch"], fallback="raise")
        cm(x).sum().backward()
        fn(ref).sum().backward()
        assert torch.equal(x.grad, ref.grad) and pipeline.compile_stats(cm).cache == {"g0": "miss"}
    assert len(entries()) == 2


def _named_act(fn):
    fn.__name__ = fn.__qualname__ = "act"  # the captured graph's code names it "act" either way
    return torch._dynamo.allow_in_graph(fn)


def _plus_one(x):
    return x + 1


def _times_ten(x):
    return x * 10


def test_a_function_the_graph_only_names_is_keyed_by_its_code():
    """`allow_in_graph` keeps a function whole in Dynamo's graph (AOTAutograd traces into it): its body is in the key."""
    for body in (_plus_one, _times_ten):
        torch._dynamo.reset()
        act = _named_act(body)
        cm = pipeline.jit(lambda x: act(x) * 2, executors=["torch"])
        assert torch.equal(cm(torch.ones(2)), body(torch.ones(2)) * 2)
        assert pipeline.compile_stats(cm).cache == {"g0": "miss"}
    assert len(entries()) == 2


def test_a_custom_ops_kernels_are_in_the_key():
    @torch.library.custom_op("test_cache::act", mutates_args=())
    def act(x: torch.Tensor) -> torch.Tensor:
        return x + 1
    act.register_fake(torch.empty_like)
    for expected in (4.0, 20.0):
        torch._dynamo.reset()
        cm = pipeline.jit(lambda x: act(x) * 2, executors=["torch"])
        assert cm(torch.ones(2)).tolist() == [expected] * 2
        assert pipeline.compile_stats(cm).cache == {"g0": "miss"}
        act.register_kernel("cpu")(_times_ten)  # the op's kernel edited: the next compile must not load the first
    assert len(entries()) == 2


def test_a_custom_op_whose_kernels_cannot_be_read_turns_the_cache_off():
    lib = torch.library.Library("test_cache_lib", "DEF")
    lib.define("act(Tensor x) -> Tensor")
    lib.impl("act", _plus_one, "CompositeImplicitAutograd")
    cm = pipeline.jit(lambda x: torch.ops.test_cache_lib.act(x) * 2, executors=["torch"])
    assert cm(torch.ones(2)).tolist() == [4.0, 4.0]
    assert pipeline.compile_stats(cm).cache["g0"].startswith("off: the graph calls custom op test_cache_lib::act")


PASS_MODULE = """
import torch
from transforms import trace_pass
SWAP = {swap}

def _replacement():
    return torch.ops.aten.{op}.Tensor

@trace_pass(runs_on="after_autodiff")
def swap_mul(trace):
    gm = trace.editable()
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.mul.Tensor and SWAP:
            node.target = _replacement()
    gm.recompile()
    return trace.derive(gm, by="swap_mul")
"""


@pytest.mark.parametrize("first, edited", [({"op": "mul", "swap": True}, {"op": "add", "swap": True}),
                                           ({"op": "add", "swap": False}, {"op": "add", "swap": True})],
                         ids=["helper", "constant"])
def test_an_edited_helper_or_constant_of_a_pass_is_a_different_entry(tmp_path, monkeypatch, first, edited):
    """A pass's key holds the module-level functions it calls and the plain values it reads, not only its own source."""
    import importlib
    monkeypatch.syspath_prepend(str(tmp_path))
    path, results = tmp_path / "user_passes_for_the_key.py", []
    for fields in (first, edited):
        path.write_text(PASS_MODULE.format(**fields))
        module = importlib.reload(sys.modules["user_passes_for_the_key"]) if results else \
            importlib.import_module("user_passes_for_the_key")
        torch._dynamo.reset()
        cm = pipeline.jit(lambda x, y: x * y, executors=["torch"], transforms=[module.swap_mul])
        results.append(cm(torch.full((2,), 3.0), torch.full((2,), 5.0)).tolist())
        assert pipeline.compile_stats(cm).cache == {"g0": "miss"}
    assert results == [[15.0, 15.0], [8.0, 8.0]] and len(entries()) == 2
    sys.modules.pop("user_passes_for_the_key")


class _Swap:
    def __init__(self, op):
        self.op = op

    def run(self, trace):
        gm = trace.editable()
        for node in gm.graph.nodes:
            if node.target is torch.ops.aten.mul.Tensor:
                node.target = getattr(torch.ops.aten, self.op).Tensor
        gm.recompile()
        return trace.derive(gm, by="swap")


def test_a_pass_that_is_a_bound_method_is_keyed_by_its_instances_fields():
    results = []
    for op in ("mul", "add"):
        torch._dynamo.reset()
        swap = trace_pass(_Swap(op).run, runs_on="after_autodiff", name="swap")
        cm = pipeline.jit(lambda x, y: x * y, executors=["torch"], transforms=[swap])
        results.append(cm(torch.full((2,), 3.0), torch.full((2,), 5.0)).tolist())
    assert results == [[15.0, 15.0], [8.0, 8.0]] and len(entries()) == 2


def test_the_default_dtype_is_in_the_key():
    """`torch.tensor(16777217.)` is 16777216 in float32 and exact in float64: the same captured graph
    lowers to other constants under another default dtype."""
    def fn(x):
        return x.double() + torch.tensor(16777217.0)

    x = torch.zeros(2)
    saved = torch.get_default_dtype()
    try:
        for dtype in (torch.float32, torch.float64):
            torch._dynamo.reset()
            torch.set_default_dtype(dtype)
            cm = pipeline.jit(fn, executors=["torch"], fallback="raise")
            assert torch.equal(cm(x), fn(x)) and pipeline.compile_stats(cm).cache == {"g0": "miss"}
    finally:
        torch.set_default_dtype(saved)
    assert len(entries()) == 2


def test_executor_without_artifacts_still_caches_the_graph_and_says_so(mlp):
    from executors import Executor

    class Plain(Executor):
        name = "plain"

        def claims_op(self, op, node):
            return op is torch.ops.aten.gelu.default

        def compile_region(self, gm, example_inputs):
            return gm.forward

    cm, out0, _ = compile_and_step(mlp, torch.randn(4, 16), executors=[Plain()])
    notes = pipeline.compile_stats(cm).cache_notes
    assert any("executor 'plain' has no serializable artifact" in n for _, n in notes)
    cm, out1, _ = compile_and_step(mlp, torch.randn(4, 16), executors=[Plain()])
    assert pipeline.compile_stats(cm).cache == {"g0": "miss"}  # its regions are compiled again


def test_model_transform_inputs_wrapper_rebuilds_from_its_metadata():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    x = torch.randn(3, 8)
    outs = []
    for _ in range(2):  # jit replaces the weights it quantizes: each round gets its own copy
        torch._dynamo.reset()
        cm = pipeline.jit(copy.deepcopy(model), executors=["torch"], transforms=[quantize("int8")])
        with torch.no_grad():
            outs.append(cm(x))
    assert pipeline.compile_stats(cm).cache == {"g0": "hit"}
    assert torch.equal(outs[0], outs[1])
    wrapper = ModelTransformInputs(cm._state.config.replaced, ["0.weight", None, None, "2.weight", None, None])
    rebuilt = ModelTransformInputs(cm._state.config.replaced, wrapper.metadata()["qualnames"])
    seen = rebuilt.post_compile(lambda *args: args)("w0", "b0", "x", "w2", "b2", "y")
    assert seen[:2] == tuple(cm._state.config.replaced["0.weight"].tensors.values()) and seen[2:4] == ("b0", "x")
    cm._state.config.replaced["0.weight"].tensors = {"q": "new q", "scale": "new scale"}  # as a checkpoint load may
    assert rebuilt.post_compile(lambda *args: args)("w0", "b0", "x", "w2", "b2", "y")[:2] == ("new q", "new scale")


def test_graph_with_input_mutations_hits_and_writes_them_back(convbn):
    """BatchNorm's running stats are input mutations: AOTAutograd's own wrappers, rebuilt on a hit,
    still write them back."""
    x = torch.randn(2, 3, 8, 8)
    results = []
    for _ in range(2):
        model = copy.deepcopy(convbn)
        cm, out, grads = compile_and_step(model, x)
        results.append((out, grads, model.bn.running_mean.clone(), model.bn.running_var.clone()))
    assert pipeline.compile_stats(cm).cache == {"g0": "hit"}
    (out0, grads0, *stats0), (out1, grads1, *stats1) = results
    assert torch.equal(out0, out1)
    assert_identical(grads0, grads1)
    assert_identical(stats0, stats1) and not torch.equal(stats0[0], torch.zeros(8))


@pytest.mark.allow_fallback
def test_a_region_whose_compile_failed_is_compiled_again_next_time(mlp):
    """A failure may be passing (memory, a crashed compile worker): the fallback that ran instead is
    not stored, so the next process tries the executor again rather than loading the fallback."""
    from executors import Executor

    class FailsOnce(Executor):
        name, failures = "fails_once", [1]

        def claims_op(self, op, node):
            return True

        def compile_region(self, gm, example_inputs):
            if self.failures:
                self.failures.pop()
                raise RuntimeError("out of memory while compiling")
            return gm.forward

        artifact_unsupported_reason = lambda self, gm, example_inputs: None  # noqa: E731
        save_region = lambda self, fn: b""  # noqa: E731
        load_region = lambda self, data, gm, example_inputs: gm.forward  # noqa: E731

    x = torch.randn(4, 16)
    first, out0, _ = compile_and_step(mlp, x, executors=[FailsOnce()])
    assert "torch" in {r.executor for r in pipeline.regions(first)}  # the first region's fallback
    assert any("failed to compile" in n for _, n in pipeline.compile_stats(first).cache_notes)
    second, out1, _ = compile_and_step(mlp, x, executors=[FailsOnce()])
    assert {r.executor for r in pipeline.regions(second)} == {"fails_once"}
    assert torch.equal(out0, out1)


@pytest.mark.allow_fallback
def test_a_region_whose_background_compile_fails_falls_back_and_is_not_stored():
    """`finish_region` completes what `compile_region` left running (Inductor's kernels). It runs once
    every region is compiled, before anything is stored; when it raises, the region and its identical
    twins run on the next executor, with a warning, as after a failed compile, and nothing is stored."""
    from helpers import Claiming
    from ir import PipelineFallbackWarning

    class Pending(Claiming):
        def __init__(self, fail):
            super().__init__("pending", tag=torch.Tag.pointwise)
            self.fail_finish, self.finished, self.stored = fail, [], []

        def compile_region(self, gm, example_inputs):
            fn = super().compile_region(gm, example_inputs)
            return lambda *args: fn(*args)  # a new callable per compile, "still compiling"

        def finish_region(self, fn):
            if self.fail_finish:
                raise RuntimeError("a compile worker crashed")
            self.finished.append(fn)

        artifact_unsupported_reason = lambda self, gm, example_inputs: None  # noqa: E731
        load_region = lambda self, data, gm, example_inputs: gm.forward  # noqa: E731

        def save_region(self, fn):
            assert fn in self.finished, "stored before finish_region"
            self.stored.append(fn)
            return b""

    def two_layers(x):
        return ((x.sin() * 2).cumsum(0).sin() * 2).cumsum(0)

    x = torch.randn(6)
    torch._dynamo.reset()
    failing = Pending(fail=True)
    cf = pipeline.jit(two_layers, executors=[failing])
    with pytest.warns(PipelineFallbackWarning, match="pending failed to compile: RuntimeError: a compile worker crashed"):
        assert torch.equal(cf(x), two_layers(x))
    regions = pipeline.regions(cf)
    assert [r.executor for r in regions] == ["torch"] * 4 and regions[2].compiled_as == 0  # the twin too
    assert "pending failed to compile" in regions[2].fallback_reason
    assert not failing.stored and len(failing.received) == 1
    assert regions[0].compile_seconds > 0 and pipeline.compile_stats(cf).seconds["dispatch"] >= 0
    torch._dynamo.reset()
    working = Pending(fail=False)
    cf = pipeline.jit(two_layers, executors=[working])
    assert torch.equal(cf(x), two_layers(x))
    assert [r.executor for r in pipeline.regions(cf)] == ["pending", "torch", "pending", "torch"]
    assert working.stored == working.finished and len(working.finished) == 1


def test_a_stage_with_identical_regions_hits(monkeypatch):
    """Regions that run an identical earlier region's code are neither compiled nor loaded: a warm
    cache still counts them as loaded, and reports a hit."""
    from helpers import Claiming

    class Pointwise(Claiming):  # its regions stored and rebuilt as their graphs, as torch's are
        def artifact_unsupported_reason(self, gm, example_inputs):
            return None

        def save_region(self, fn):
            return b""

        def load_region(self, data, gm, example_inputs):
            return gm.forward

    def two_layers(x):
        return ((x.sin() * 2).cumsum(0).sin() * 2).cumsum(0)

    x = torch.randn(6)
    for expected in ("miss", "hit"):
        torch._dynamo.reset()
        cf = pipeline.jit(two_layers, executors=[Pointwise("pointwise", tag=torch.Tag.pointwise)])
        assert torch.equal(cf(x), two_layers(x))
        assert pipeline.compile_stats(cf).cache == {"g0": expected}
        assert [r.compiled_as for r in pipeline.regions(cf)][:3] == [None, None, 0]
