"""A cache hit starts warm: AOTAutograd's own entry, kept in ours, is loaded instead of lowering
again (`pipeline/warm_start.py`); whatever cannot take that path still compiles, saying why."""
import copy

import torch
import torch.nn as nn

import pipeline
from executors.base import RebuiltFromGraph
from executors.plan import unbuilt
from pipeline import trace_pickle, warm_start
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
    assert stages(warm) == ["captured", "forward", "backward"]  # the stored execution traces: nothing traced
    assert pipeline.last_traces(warm)[-1].provenance[-1].name == "dispatch: compile or load regions (warm start)"
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


def test_a_graph_that_does_not_pickle_compiles_and_says_why(mlp, monkeypatch):
    def unpicklable(self):
        raise TypeError("cannot pickle 'generator' object")
    monkeypatch.setattr(warm_start.StageCode, "prepare_for_serialization", unpicklable)
    cm, _, _ = compile_and_step(mlp, torch.randn(4, 16))
    assert "no warm start: the lowered graph does not pickle (TypeError: cannot pickle 'generator' object)" \
        in notes(cm), notes(cm)


def test_debug_metadata_is_not_stored_and_the_compiled_trace_keeps_it():
    """Source lines and module paths are left out of the stored stages (half their size, and a
    model class pickle cannot name no longer stops a warm start); the live traces keep theirs."""
    class Local(nn.Module):  # a class defined in a function: pickle cannot name it
        def forward(self, x):
            return x.sin() * 2
    model = nn.Sequential(nn.Linear(5, 4), Local())
    x = torch.randn(3, 5)
    cold, out0, _ = compile_and_step(model, x)
    forward = next(t for t in pipeline.last_traces(cold) if t.stage.value == "forward")
    assert any("stack_trace" in n.meta for n in forward.graph.nodes)
    warm, out1, _ = compile_and_step(model, x)
    assert pipeline.compile_stats(warm).cache == {"g0": "hit"} and "lower" not in pipeline.compile_stats(warm).seconds
    for t in pipeline.last_traces(warm)[1:]:
        assert not any(set(n.meta) & set(trace_pickle.DEBUG_META) for n in t.graph.nodes), t.name
    assert torch.equal(out0, out1)


def test_symbolic_shapes_compile_without_a_warm_start(mlp):
    torch._dynamo.reset()
    cm = pipeline.jit(mlp, executors=["torch"], dynamic=True)
    cm(torch.randn(4, 16)).sum().backward()
    assert "no warm start: symbolic shapes" in notes(cm)


def test_a_graph_an_executor_prepared_loads_only_with_the_same_bindings(mlp, monkeypatch):
    """An executor's `prepare` may bind this model's own state into the graph (TE's fp8 scaling
    handle, numbered per process in jit order): the stored lowering loads only when prepare made
    the very same graph here; with another binding it is lowered again, never loaded. The prepared
    graph is checked (verifier, types) unless it is the very graph that passed when it was stored."""
    import pipeline.compiler
    from executors import Executor
    from executors.torch_executor import torch_executor
    from ir.rewrite import add_call

    class Preparing(Executor):
        name = "preparing"

        def __init__(self, handle):
            self.handle = handle

        def claims_op(self, op, node):
            return torch_executor.claims_op(op, node)

        def compile_region(self, gm, example_inputs):
            return gm

        def prepare(self, trace):  # out + 0 * handle: the handle is in the graph, the values unchanged
            gm = trace.editable()
            output = gm.graph.output_node()
            out = output.args[0][0]
            with gm.graph.inserting_before(output):
                bound = add_call(gm.graph, torch.ops.aten.add.Tensor, (out, 0), out.meta["val"])
                bound.kwargs = {"alpha": self.handle}
            output.args = ((bound, *output.args[0][1:]),)
            gm.recompile()
            return trace.derive(gm, by="preparing.prepare"), []
    x = torch.randn(4, 16)
    runs, checked, real_check = [], [], pipeline.compiler.check_built_in
    monkeypatch.setattr(pipeline.compiler, "check_built_in", lambda *a: (checked.append(a[2]), real_check(*a)))
    for handle in (0, 1, 1):
        cm, out, _ = compile_and_step(mlp, x, executors=[Preparing(handle)])
        runs.append(("lower" in pipeline.compile_stats(cm).seconds, notes(cm), len(checked)))
        torch.testing.assert_close(out, mlp(x), rtol=0, atol=0)
    assert runs[0][0] and runs[1][0] and not runs[2][0], runs
    assert [r[2] for r in runs] == [1, 2, 2]  # the warm start does not check its stored graph again
    assert any("no warm start: preparing.prepare made another graph than the stored one" in n for n in runs[1][1])


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


class _Matmuls(RebuiltFromGraph):
    """An operator executor taking the linears' addmm: each layer gives regions of two executors."""
    name, kind = "matmuls", "operator"

    def claims_op(self, op, node):
        return op in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)

    def compile_region(self, gm, example_inputs):
        return gm.forward


def test_a_stage_is_stored_partitioned_each_kind_of_region_once():
    """What is stored is the execution trace before its regions were built: its graph keeps every
    value (sizes, strides, offset, dtype, device, and which values share memory), and the regions
    of identical layers store one graph. A warm start builds the same regions from it."""
    from torch.multiprocessing.reductions import StorageWeakRef

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    x = torch.randn(3, 8)
    cold, out0, grads0 = compile_and_step(model, x, executors=[_Matmuls(), "torch"])
    executed = [t for t in pipeline.last_traces(cold) if t.provenance[-1].name.startswith("dispatch")]
    assert [t.stage.value for t in executed] == ["forward", "backward"]
    for trace in executed:
        loaded = trace_pickle.loads(trace_pickle.dumps(unbuilt(trace.module)))
        before, after = list(trace.graph.nodes), list(loaded.graph.nodes)
        assert [n.name for n in before] == [n.name for n in after] and str(trace.graph) == str(loaded.graph)
        calls = [n.target for n in after if n.op == "call_module"]
        first_of_kind = [c for c in calls if trace.module.get_submodule(c).region.compiled_as is None]
        assert len({id(loaded.get_submodule(c)) for c in calls}) == len(first_of_kind) < len(calls) - 2
        assert all(str(loaded.get_submodule(c).code) == str(trace.module.get_submodule(c).source.code)
                   for c in first_of_kind)
        tensors = [(a.meta["val"], b.meta["val"]) for a, b in zip(before, after)
                   if isinstance(a.meta.get("val"), torch.Tensor)]
        assert len(tensors) > 5
        for p, q in tensors:
            assert (p.shape, p.stride(), p.storage_offset(), p.dtype, p.device) == \
                (q.shape, q.stride(), q.storage_offset(), q.dtype, q.device)
        same = [[StorageWeakRef(p.untyped_storage()) == StorageWeakRef(q.untyped_storage()) for p, _ in tensors]
                for q, _ in tensors]
        assert same == [[StorageWeakRef(p.untyped_storage()) == StorageWeakRef(q.untyped_storage())
                         for _, p in tensors] for _, q in tensors] and any(sum(row) > 1 for row in same)
    warm, out1, grads1 = compile_and_step(model, x, executors=[_Matmuls(), "torch"])
    assert pipeline.compile_stats(warm).cache == {"g0": "hit"}, notes(warm)
    assert {r.executor for r in pipeline.regions(warm)} == {"matmuls", "torch"}
    table = [(r.id, r.stage, r.executor, r.ops, r.compiled_as, r.input_shapes) for r in pipeline.regions(cold)]
    assert [(r.id, r.stage, r.executor, r.ops, r.compiled_as, r.input_shapes) for r in pipeline.regions(warm)] == table
    assert len({r.id for r in pipeline.regions(warm)}) == len(table)  # twins described once, each its own row
    assert torch.equal(out0, out1)
    assert_identical(grads0, grads1)



def test_a_warm_start_runs_each_stages_stored_code_and_another_graph_gets_its_own(monkeypatch):
    """The boxed stage's code is stored with the stage: a warm start executes it instead of generating it
    again (~0.5 s of a 16-layer warm start on the CPU). Code stored for another graph is never used."""
    from pipeline import boxed as boxed_module
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
    x = torch.randn(3, 8)
    cold, out0, grads0 = compile_and_step(model, x, executors=[_Matmuls(), "torch"])
    generated, original = [], boxed_module._region_calls_boxed
    monkeypatch.setattr(boxed_module, "_region_calls_boxed", lambda *a: generated.append(1) or original(*a))
    warm, out1, grads1 = compile_and_step(model, x, executors=[_Matmuls(), "torch"])
    assert pipeline.compile_stats(warm).cache == {"g0": "hit"}, notes(warm)
    assert generated == [] and torch.equal(out0, out1)
    assert_identical(grads0, grads1)

    def executed(cm):
        return [t.module for t in pipeline.last_traces(cm) if t.provenance[-1].name.startswith("dispatch")]
    forward, backward = executed(warm)
    assert [m.meta["boxed_code"] for m in (forward, backward)] == [m.meta["boxed_code"] for m in executed(cold)]

    run = boxed_module.boxed(forward, backward.meta["boxed_code"])  # another graph's code: generated again
    assert len(generated) == 1 and forward.meta["boxed_code"] == executed(cold)[0].meta["boxed_code"]
    args = [torch.randn(n.meta["val"].shape) for n in forward.graph.nodes if n.op == "placeholder"]
    assert all(torch.equal(a, b) for a, b in zip(run(list(args)), forward(*args)))


def test_te_and_nvfuser_regions_are_cached_and_a_warm_start_loads_them(te_on_cpu, nvfuser_claims_on_cpu):
    """Nothing of theirs is compiled to store (TE calls its kernels; nvfuser_direct cannot serialize
    a fusion): their regions are rebuilt from the graph, so a second process starts warm — no
    lowering, every region loaded — instead of missing on them."""
    from models import Llama, LlamaConfig
    config = LlamaConfig(vocab=64, dim=32, layers=1, heads=4, kv_heads=2, hidden=64, max_seq=16)
    torch.manual_seed(0)
    model, x = Llama(config), torch.randint(0, 64, (2, 8))
    listed = [te_on_cpu, nvfuser_claims_on_cpu, "torch"]
    compile_and_step(model, x, executors=listed)
    warm, *_ = compile_and_step(model, x, executors=listed)
    stats = pipeline.compile_stats(warm)
    assert stats.cache == {"g0": "hit"} and "lower" not in stats.seconds, notes(warm)
    assert not any(k.startswith("compile:") for k in stats.seconds), stats.seconds
    assert {"te", "nvfuser"} <= {r.executor for r in pipeline.regions(warm)}


def test_a_warm_start_binds_what_te_prepare_bound_without_preparing_again(te_on_cpu, monkeypatch):
    """TE's `prepare` (and the `group_linears` it asks for) runs at a cold start only: the entry keeps what it
    bound (`binding`), a warm start binds that again (`bind_again`) and loads the stored stages, with the same
    regions and results. When the executor cannot bind it again, a warm start prepares as before."""
    from executors.te_executor import TEExecutor
    from models import Llama, LlamaConfig
    config = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, max_seq=16)
    torch.manual_seed(0)
    model, x = Llama(config), torch.randint(0, 64, (2, 8))
    cold, out0, grads0 = compile_and_step(model, x, executors=[te_on_cpu, "torch"])
    prepared = []
    real_prepare = TEExecutor.prepare
    monkeypatch.setattr(TEExecutor, "prepare", lambda self, trace: prepared.append(1) or real_prepare(self, trace))
    warm, out1, grads1 = compile_and_step(model, x, executors=[te_on_cpu, "torch"])
    stats = pipeline.compile_stats(warm)
    assert stats.cache == {"g0": "hit"} and "lower" not in stats.seconds and not prepared, notes(warm)
    assert any(note.startswith("prepare not run") for _, note in stats.cache_notes), notes(warm)
    assert "te" in {r.executor for r in pipeline.regions(warm)}
    assert [(r.stage, r.executor, r.ops) for r in pipeline.regions(warm)] == \
        [(r.stage, r.executor, r.ops) for r in pipeline.regions(cold)]
    assert torch.equal(out0, out1)
    assert_identical(grads0, grads1)
    monkeypatch.setattr(TEExecutor, "bind_again", lambda self, binding: False)
    again, out2, _ = compile_and_step(model, x, executors=[te_on_cpu, "torch"])
    assert pipeline.compile_stats(again).cache == {"g0": "hit"} and prepared, notes(again)
    assert not any(note.startswith("prepare not run") for _, note in pipeline.compile_stats(again).cache_notes)
    assert torch.equal(out0, out2)


def test_te_binds_delayed_scaling_again_only_to_the_same_handle_and_indices():
    """`bind_again` registers the stored linears in their order on a fresh state, or on one whose first linears are
    the same (another graph of the model); another handle or other linears first: refused, the state unchanged."""
    from executors.te_executor import TEExecutor

    class DelayedScaling:  # stands in for transformer_engine.common.recipe.DelayedScaling (not on CPU)
        margin, amax_history_len, amax_compute_algo, scaling_factor_compute_algo = 0, 8, "max", None

    cold = TEExecutor().fp8(DelayedScaling()).for_model()
    for name in ("wq.weight", "wo.weight", "w1.weight"):
        cold.scaling.register(name)
    binding = cold.binding()
    warm = TEExecutor().fp8(DelayedScaling()).for_model()
    assert not warm.bind_again(binding) and warm.scaling.names == {}  # another handle: another jitted model
    warm.scaling.handle = cold.scaling.handle  # as the first jitted model of another process has
    warm.scaling.register("w2.weight")
    assert not warm.bind_again(binding) and warm.scaling.names == {"w2.weight": 0}
    warm.scaling.names.clear()
    warm.scaling.register("wq.weight")
    assert warm.bind_again(binding) and warm.scaling.names == cold.scaling.names
    bf16 = TEExecutor()
    assert bf16.bind_again(bf16.binding())


def test_a_stage_reading_a_constant_outside_its_regions_starts_warm():
    """A tensor made in forward (`torch.tensor([...])`) is a constant of the lowered stages, read by a
    `get_attr` outside the regions: it is stored with the stage, and the warm start computes the same."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, x):
            return self.linear(x) * torch.tensor([1.0, 2.0, 3.0])

    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(2, 3)
    cold, out0, grads0 = compile_and_step(model, x)
    assert any(n.op == "get_attr" for t in pipeline.last_traces(cold) for n in t.graph.nodes)
    warm, out1, grads1 = compile_and_step(model, x)
    stats = pipeline.compile_stats(warm)
    assert stats.cache == {"g0": "hit"} and "lower" not in stats.seconds, notes(warm)
    assert torch.equal(out0, out1)
    assert_identical(grads0, grads1)
