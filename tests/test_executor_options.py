"""Executor options that are checked without the hardware they need."""
import pytest

import executors


def test_te_fp8_rejects_an_unknown_recipe_and_names_the_supported_ones():
    with pytest.raises(TypeError, match="DelayedScaling.*Float8CurrentScaling"):
        executors.te.fp8("delayed")


def test_te_groups_linears_by_default_in_fp8_only():
    """Grouping pays in fp8 (one cast of the shared input) but not in bf16 (stacking the weights costs
    more than the larger GEMMs gain, measured on the H200); an explicit choice survives fp8()."""
    te = executors.te
    assert not te.group_linears and te.fp8().group_linears
    assert te.options(group_linears=True).group_linears
    assert not te.options(group_linears=False).fp8().group_linears
    assert not te.options(group_linears=False).fp8().options().group_linears  # options() keeps what it is not given
    assert te.fp8().options(group_linears=False).options(group_linears=None).group_linears  # None: the default
    assert te.options(group_linears=True).cache_token() != te.cache_token()


def test_te_delayed_scaling_state_is_per_jitted_model():
    class DelayedScaling:  # stands in for transformer_engine.common.recipe.DelayedScaling (not on CPU)
        margin, amax_history_len, amax_compute_algo, scaling_factor_compute_algo = 0, 8, "max", None

    te = executors.te.fp8(DelayedScaling())
    a, b = te.for_model(), te.for_model()
    assert a.scaling is not b.scaling and a.scaling.handle != b.scaling.handle
    assert executors.te.for_model() is executors.te  # bf16: stateless, shared


def test_te_delayed_scaling_rejects_custom_algorithms():
    class DelayedScaling:
        margin, amax_history_len, scaling_factor_compute_algo = 0, 8, None
        amax_compute_algo = staticmethod(lambda history: history.max())

    with pytest.raises(NotImplementedError, match="amax_compute_algo"):
        executors.te.fp8(DelayedScaling()).for_model()


@pytest.mark.parametrize("fp8, scaling, bias", [(False, -1, True), (False, -1, False), (True, -1, True), (True, 0, False)])
def test_te_linear_ops_autograd_structure_on_fake_tensors(fp8, scaling, bias):
    """The custom ops' autograd is checked with their fake kernels, which need no GPU: the backward
    returns a gradient slot for every argument, also when the scaling arguments have simple values."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import executors.te_executor  # noqa: F401  (registers pipeline_te::linear)
    with FakeTensorMode():
        x = torch.randn(32, 16, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(48, 16, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(48, dtype=torch.bfloat16, requires_grad=True) if bias else None
        y = torch.ops.pipeline_te.linear(x, w, b, fp8, scaling, 0)[0]
        assert y.shape == (32, 48)
        y.sum().backward()
        assert x.grad.shape == x.shape and w.grad.shape == w.shape
        assert (b.grad.shape == b.shape) if bias else True


def test_te_delayed_scaling_names_each_linears_state_after_its_weight(monkeypatch):
    """The swap before autodiff registers every linear under its weight's qualified name, which
    becomes the `<module>._extra_state.weight_fp8_*` keys of the state dict. The TE ops are made to
    fail when the compiled code runs (TE needs CUDA tensors); the names are in place before that."""
    import torch

    import pipeline
    from executors import te_executor
    from executors.te_executor import TEExecutor
    from models import Llama, LlamaConfig

    class DelayedScaling:
        margin, amax_history_len, amax_compute_algo, scaling_factor_compute_algo = 0, 8, "max", None

    def not_run(*args):  # real TE handed these CPU tensors would read them as device memory
        raise RuntimeError("TE's GEMM is not run in this test")

    monkeypatch.setattr(TEExecutor, "unavailable_reason", lambda self: None)
    monkeypatch.setattr(TEExecutor, "_reject", lambda self, node: None)
    for op in (torch.ops.pipeline_te.linear.default, torch.ops.pipeline_te.linear_backward.default):
        monkeypatch.setitem(te_executor._IMPLEMENTATIONS, op, not_run)
    model = Llama(LlamaConfig(vocab=64, dim=32, layers=1, heads=4, kv_heads=2, hidden=64, max_seq=16))
    linears = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    # one state per linear; grouped (the default), one per group, named after its first member
    firsts = ["head.weight", "layers.0.attn.wq.weight", "layers.0.attn.wo.weight", "layers.0.mlp.w1.weight",
              "layers.0.mlp.w2.weight"]
    for te, names in [(TEExecutor().options(group_linears=False), linears), (TEExecutor(), firsts)]:
        cm = pipeline.jit(model.bfloat16(), executors=[te.fp8(DelayedScaling()), "torch"])
        with pytest.raises(Exception):
            cm(torch.randint(0, 64, (2, 8)))
        assert sorted(cm._state.config.executors[0].scaling.names) == sorted(names)


def test_te_regions_call_the_ops_implementation_directly(monkeypatch):
    """After AOTAutograd a TE region needs no dispatcher (no autograd, no aliasing checks): its
    compiled form calls the Python implementation; the region's own graph is left as it was."""
    import operator

    import torch
    import torch.fx as fx

    import executors.te_executor as te

    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    call = graph.call_function(torch.ops.pipeline_te.linear.default, (x, w, None, False, -1, -1))
    graph.output((graph.call_function(operator.getitem, (call, 0)),))
    region = fx.GraphModule(torch.nn.Module(), graph)
    calls = []
    monkeypatch.setitem(te._IMPLEMENTATIONS, torch.ops.pipeline_te.linear.default,
                        lambda *args: calls.append(args) or [args[0] @ args[1].t()])
    compiled = te.TEExecutor().compile_region(region, [])
    a, b = torch.randn(2, 3), torch.randn(4, 3)
    (y,) = compiled(a, b)
    assert len(calls) == 1 and calls[0][0] is a and calls[0][2:] == (None, False, -1, -1)
    assert torch.equal(y, a @ b.t())
    assert call.target is torch.ops.pipeline_te.linear.default


def _reference_te_ops(monkeypatch):
    """Stands TE's bf16 GEMMs in with torch's, so the `te` executor's graph work — the swap before
    autodiff, grouping, matmuls with a weight, the ops' autograd, regions calling the implementations —
    runs end to end on the CPU and is compared with eager."""
    import torch

    import executors.te_executor as te

    def linear(x, weight, bias, fp8, scaling, index):
        assert not fp8
        return [torch.nn.functional.linear(x, weight, bias)]

    def linear_backward(dy, saved, has_bias, fp8, scaling, index):
        x, weight = saved
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        out = [dy @ weight, dy2.t() @ x2]
        return out + [dy2.sum(0)] if has_bias else out

    monkeypatch.setattr(te.TEExecutor, "unavailable_reason", lambda self: None)
    monkeypatch.setattr(te.TEExecutor, "_reject", lambda self, node: None)
    monkeypatch.setitem(te._IMPLEMENTATIONS, torch.ops.pipeline_te.linear.default, linear)
    monkeypatch.setitem(te._IMPLEMENTATIONS, torch.ops.pipeline_te.linear_backward.default, linear_backward)
    return te.TEExecutor


@pytest.mark.parametrize("group", [False, True])
def test_te_graph_work_trains_like_eager_with_reference_gemms(monkeypatch, group):
    import copy

    import torch

    import pipeline
    from models import Llama, LlamaConfig
    from models.llama import next_token_loss

    TEExecutor = _reference_te_ops(monkeypatch)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, max_seq=16))
    eager = copy.deepcopy(model)
    cm = pipeline.jit(model, executors=[TEExecutor().options(group_linears=group), "torch"])
    tokens = torch.randint(0, 64, (2, 16))
    loss, ref = next_token_loss(cm(tokens), tokens), next_token_loss(eager(tokens), tokens)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    te_regions = [r for r in pipeline.regions(cm) if r.executor == "te"]
    assert len(te_regions) == 2 * (9 if group else 15)  # forward and backward, one per (grouped) linear


def test_te_takes_matmuls_with_a_weight_like_linears(monkeypatch):
    """`x @ W` with W a parameter becomes a TE linear on W's transpose; a matmul of two activations
    stays a matmul. Outputs and gradients as in eager (reference GEMMs on the CPU)."""
    import copy
    import operator

    import torch

    import pipeline

    class Projections(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 32))

        def forward(self, x):
            h = x @ self.w
            return h @ h.transpose(-1, -2)

    TEExecutor = _reference_te_ops(monkeypatch)
    model = Projections()
    eager = copy.deepcopy(model)
    cm = pipeline.jit(model, executors=[TEExecutor(), "torch"])
    x = torch.randn(2, 8, 16)
    out, ref = cm(x), eager(x)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(model.w.grad, eager.w.grad)
    swapped = next(t for t in pipeline.last_traces(cm) if t.provenance[-1].name == "te.swap_linears")
    targets = [n.target for n in swapped.module.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.pipeline_te.linear.default) == 1
    assert sum(t in (torch.matmul, operator.matmul) for t in targets) == 1


def test_te_delayed_scaling_resumed_from_a_state_dict_continues_like_the_uninterrupted_run():
    """The saved state holds the last step's amaxes not yet folded into the scales; a model that loads
    it folds them in before its first cast, as the uninterrupted model does at its next call. (Torch's
    arithmetic stands in for TE's fused update kernel on the CPU.)"""
    import torch

    from executors.te_scaling import DelayedScalingState

    class DelayedScaling:
        margin, amax_history_len, amax_compute_algo, scaling_factor_compute_algo = 0, 4, "max", None

    running = DelayedScalingState(DelayedScaling())
    for name in ("a.weight", "b.weight"):
        running.register(name)
    running.allocate("cpu")   # at compile time
    running.ran |= {0, 1}     # both linears ran (their casts are simulated below)
    for step in range(3):  # casts record amaxes in row 0; the next call's update folds them in
        running.update()
        running.forward.view(0, 4)[0][0] = torch.tensor([2.0, 3.0, 5.0, 7.0]) * (step + 1)
        running.backward.view(0, 2)[0][0] = torch.tensor([11.0, 13.0]) * (step + 1)
    saved = running.state()
    assert set(saved) == {"a.weight", "b.weight"} and saved["a.weight"]["fp8_amax_history"].shape == (4, 3)

    resumed = DelayedScalingState(DelayedScaling())
    for name, tensors in saved.items():
        resumed.load(name, tensors)     # before the model has run: kept until its linears exist
    for name in ("a.weight", "b.weight"):
        resumed.register(name)
    resumed.update()                    # the first call's update: nothing allocated yet
    resumed.allocate("cpu")              # the first cast: allocates, loads, folds the amaxes in
    running.update()                    # the uninterrupted run's next call
    for name, tensors in running.state().items():
        for key, value in tensors.items():
            assert torch.equal(resumed.state()[name][key], value), (name, key)
    torch.testing.assert_close(running.forward.view(0, 2)[1], torch.tensor([448.0 / 6, 448.0 / 9]))  # max over history


def test_te_leaves_a_matmul_it_cannot_take_alone_with_the_reason(monkeypatch):
    """On the CPU TE rejects every linear: `x @ W` then stays a matmul (no transposed copy of W),
    and compile_stats says why."""
    import operator

    import torch

    import pipeline
    from executors.te_executor import TEExecutor

    monkeypatch.setattr(TEExecutor, "unavailable_reason", lambda self: None)
    w = torch.nn.Parameter(torch.randn(16, 32))
    model = torch.nn.Module()
    model.w = w
    model.forward = lambda x: x @ model.w
    cm = pipeline.jit(model, executors=[TEExecutor(), "torch"])
    x = torch.randn(4, 16)
    torch.testing.assert_close(cm(x), x @ w)
    captured = [t for t in pipeline.last_traces(cm) if t.level == "torch"][-1]
    targets = [n.target for n in captured.module.graph.nodes if n.op == "call_function"]
    assert operator.matmul in targets or torch.matmul in targets
    assert torch.t not in targets
    assert any(op == "matmul" and "TE needs CUDA" in why for _, op, why in pipeline.compile_stats(cm).op_fallbacks)


def test_te_delayed_scaling_casts_with_current_scaling_until_amaxes_are_recorded(monkeypatch):
    """Before any amax is recorded the scales are 1, which flushes small gradients to zero in e5m2:
    each direction casts with current scaling until a call of it has recorded amaxes (measured on
    the tensors: an all-zero one records 0, not fp8_max), and the next update turns them into
    delayed scales. Two forwards before a backward (gradient accumulation) leave the backward cold.
    A state loaded from a checkpoint is not cold. (Stand-ins for TE's quantizers on the CPU.)"""
    import torch

    from executors import te_scaling
    from executors.te_scaling import DelayedScalingState

    class DelayedScaling:
        margin, amax_history_len, amax_compute_algo, scaling_factor_compute_algo = 0, 4, "max", None

    monkeypatch.setattr(te_scaling, "current_quantizer", lambda fmt, columnwise=True: f"current {fmt}" + ("" if columnwise else " rowwise"))
    state = DelayedScalingState(DelayedScaling())
    index = state.register("a.weight")
    state.update()                                       # the first call's update: nothing yet
    assert state.forward_quantizers(index, "cpu") == ("current e4m3 rowwise",) * 2   # only the TN GEMM reads them
    state.recorded_forward(index, torch.full((2, 2), -3.0), torch.full((2, 2), 0.5))
    state.recorded_forward(index, torch.full((2, 2), 4.0), torch.zeros(2, 2))   # a second use: the max
    state.update()                                       # a second forward before any backward
    assert not state.forward.cold and state.backward.cold
    assert state.backward_quantizer(index, "cpu") == "current e5m2"
    torch.testing.assert_close(state.forward.view(0, 2)[1], torch.tensor([448.0 / 4.0, 448.0 / 0.5]))
    state.recorded_backward(index, torch.zeros(3))       # an all-zero gradient: amax 0, scale kept
    state.recorded_backward(index, torch.full((3,), 1e-6))
    state.update()
    assert not state.backward.cold                       # casts now use the delayed quantizers
    torch.testing.assert_close(state.backward.view(0, 1)[1], torch.tensor([57344.0 / 1e-6]))

    zero = DelayedScalingState(DelayedScaling())
    zero.register("z.weight")
    zero.allocate("cpu")
    zero.recorded_backward(0, torch.zeros(3))
    zero.update()
    torch.testing.assert_close(zero.backward.view(0, 1)[0][:, 0], torch.zeros(4))   # nothing pinned

    resumed = DelayedScalingState(DelayedScaling())
    resumed.load("a.weight", state.state()["a.weight"])
    resumed.register("a.weight")
    resumed.allocate("cpu")
    assert not resumed.forward.cold and not resumed.backward.cold


def test_te_delayed_scaling_warns_when_loaded_state_matches_no_linear():
    """A checkpoint saved with ungrouped linears, loaded into a grouped model, has states for k/v
    that no linear uses: saving says so instead of silently carrying them."""
    import torch

    from executors.te_scaling import DelayedScalingState

    class DelayedScaling:
        margin, amax_history_len, amax_compute_algo, scaling_factor_compute_algo = 0, 4, "max", None

    state = DelayedScalingState(DelayedScaling())
    tensors = {"fp8_scale": torch.ones(3), "fp8_amax_history": torch.zeros(4, 3)}
    for name in ("attn.wq.weight", "attn.wk.weight"):
        state.load(name, dict(tensors))
    state.register("attn.wq.weight")
    state.allocate("cpu")
    with pytest.warns(UserWarning, match=r"attn\.wk\.weight.*group_linears"):
        saved = state.state()
    assert set(saved) == {"attn.wq.weight", "attn.wk.weight"}


def test_te_delayed_scaling_state_grows_without_moving_its_buffers():
    """Linears registering after a graph ran (a later graph, a recompile) get new buffers; the ones
    already handed to quantizers and recorded in CUDA graphs stay where they are and keep their
    values, and the update covers every chunk."""
    import torch

    from executors.te_scaling import DelayedScalingState

    class DelayedScaling:
        margin, amax_history_len, amax_compute_algo, scaling_factor_compute_algo = 0, 4, "max", None

    state = DelayedScalingState(DelayedScaling())
    state.register("a.weight")
    state.allocate("cpu")
    history, scale = state.forward.view(0, 2)
    history[0] = torch.tensor([2.0, 4.0])
    state.update()
    before = (history.data_ptr(), scale.data_ptr(), scale.clone())
    state.register("b.weight")
    state.allocate("cpu")
    assert len(state.forward.chunks) == 2 and state.forward.columns == 4
    history, scale = state.forward.view(0, 2)
    assert (history.data_ptr(), scale.data_ptr()) == before[:2]
    torch.testing.assert_close(scale, before[2])
    torch.testing.assert_close(scale, torch.tensor([448.0 / 2, 448.0 / 4]))
    b_history, _ = state.forward.view(2, 2)
    b_history[0] = torch.tensor([8.0, 16.0])
    state.update()
    torch.testing.assert_close(torch.cat([state.forward.view(0, 2)[1], state.forward.view(2, 2)[1]]),
                               torch.tensor([448.0 / 2, 448.0 / 4, 448.0 / 8, 448.0 / 16]))
    state.ran |= {0, 1}
    assert set(state.state()) == {"a.weight", "b.weight"}
