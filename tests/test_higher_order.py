"""Double backward: a potential whose forward computes forces = -dE/dx with autograd.grad."""
import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pipeline


class Potential(nn.Module):
    """Energy of a set of atoms from their positions; forces are its negative gradient."""

    def __init__(self, detach_features=False):
        super().__init__()
        self.embed, self.hidden, self.out = nn.Linear(3, 16), nn.Linear(16, 16), nn.Linear(16, 1)
        self.detach_features = detach_features

    def forward(self, positions):
        positions = positions.requires_grad_(True)
        h = torch.tanh(self.embed(positions))
        if self.detach_features:
            h = h + 0.1 * h.detach() ** 2  # a detach the user wrote: it must stay
        energy = self.out(F.silu(self.hidden(h))).sum()
        forces = -torch.autograd.grad(energy, positions, create_graph=True)[0]
        return energy, forces


def train_step(model, positions, target_forces):
    energy, forces = model(positions.clone())
    loss = ((forces - target_forces) ** 2).mean() + 0.01 * energy
    loss.backward()
    return energy, forces, loss


def _energy_and_forces(energy_of, positions):
    energy = energy_of(positions).sum()
    return energy, -torch.autograd.grad(energy, positions, create_graph=True)[0]


class PotentialThroughAHelper(Potential):
    """autograd.grad called from a module-level helper, not in forward's own code."""

    def forward(self, positions):
        return _energy_and_forces(lambda p: self.out(F.silu(self.hidden(torch.tanh(self.embed(p))))),
                                  positions.requires_grad_(True))


@pytest.mark.parametrize("make", [Potential, lambda: Potential(detach_features=True), PotentialThroughAHelper],
                         ids=["plain", "detach_features", "through a helper"])
def test_force_training_matches_eager_with_torch_executor(make):
    model = make()
    eager = copy.deepcopy(model)
    cm = pipeline.jit(model, executors=["torch"], fallback="raise")
    positions, target = torch.randn(7, 3), torch.randn(7, 3)
    e_ref, f_ref, loss_ref = train_step(eager, positions, target)
    e, f, loss = train_step(cm, positions, target)
    assert torch.equal(f, f_ref) and torch.equal(e, e_ref)
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_autograd_grad_is_found_in_forward_and_the_helpers_it_calls():
    from pipeline.grad_capture import differentiates_inside
    assert differentiates_inside(Potential()) and differentiates_inside(PotentialThroughAHelper())
    assert not differentiates_inside(nn.Linear(2, 2)) and not differentiates_inside(lambda x: x.grad)


def test_force_computation_is_an_explicit_graph_in_executor_regions():
    cm = pipeline.jit(Potential(), executors=["torch"])
    train_step(cm, torch.randn(5, 3), torch.randn(5, 3))
    traces = pipeline.last_traces(cm)
    forward = next(t for t in traces if t.name == "g0_forward")
    assert "aten.tanh_backward.default" in str(forward)      # the inner gradient, as ops
    assert pipeline.compile_stats(cm).eager_fallbacks == {}
    forward_regions = [r for r in pipeline.regions(cm) if r.stage == "forward"]
    assert any("tanh_backward" in r.ops for r in forward_regions)
    assert "make_fx through autograd.grad" in traces[0].provenance[0].name


def test_force_model_recompiles_for_a_new_shape_only():
    cm = pipeline.jit(Potential(), executors=["torch"])
    for n in (5, 5, 9):
        train_step(cm, torch.randn(n, 3), torch.randn(n, 3))
    stats = pipeline.compile_stats(cm)
    assert stats.graphs == 2 and stats.recompilations == 1


@pytest.mark.inductor
def test_force_training_matches_eager_with_inductor():
    model = Potential()
    eager = copy.deepcopy(model)
    cm = pipeline.jit(model, executors=["inductor"])
    positions, target = torch.randn(6, 3), torch.randn(6, 3)
    _, f_ref, _ = train_step(eager, positions, target)
    _, f, _ = train_step(cm, positions, target)
    torch.testing.assert_close(f, f_ref)
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert {r.executor for r in pipeline.regions(cm)} == {"inductor"}


def test_a_hook_added_or_removed_after_the_first_call_takes_effect_through_autograd_grad():
    """This path keys its compilations on each submodule's hooks too: a later hook was silently ignored."""
    model = Potential()
    cm, positions = pipeline.jit(model, executors=["torch"], fallback="raise"), torch.randn(5, 3)
    cm(positions.clone())
    handle = model.hidden.register_forward_hook(lambda m, i, o: o * 2)
    for _ in range(2):
        for got, want in zip(cm(positions.clone()), model(positions.clone())):
            torch.testing.assert_close(got, want)
        handle.remove()
    assert pipeline.compile_stats(cm).recompilations == 1  # with the hook; without it again is the first entry


def test_switching_a_submodule_or_the_default_dtype_compiles_again():
    """The path through autograd.grad keys its compilations on every submodule's train/eval and the
    global modes, as Dynamo's guards do on the other path: a dropout switched off takes effect."""
    class WithDropout(Potential):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, positions):
            positions = positions.requires_grad_(True)
            energy = self.out(self.drop(torch.tanh(self.embed(positions)))).sum()
            return energy, -torch.autograd.grad(energy, positions, create_graph=True)[0]

    model = WithDropout()
    cm = pipeline.jit(model, executors=["torch"], fallback="raise")
    positions = torch.randn(5, 3)
    cm(positions.clone())
    model.drop.eval()
    for _ in range(2):
        energy, forces = cm(positions.clone())
        energy_ref, forces_ref = model(positions.clone())
        assert torch.equal(energy, energy_ref) and torch.equal(forces, forces_ref)
    saved = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        cm(positions.clone())
    finally:
        torch.set_default_dtype(saved)
    assert pipeline.compile_stats(cm).recompilations == 2



SCALE = 1.0  # a module-level value the forward reads


class Scaled(Potential):
    """Reads a plain attribute and a module-level value, rebinds a buffer, and normalises by a value under no_grad."""

    def __init__(self):
        super().__init__()
        self.scale = 1.0
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, positions):
        positions = positions.requires_grad_(True)
        with torch.no_grad():
            norm = self.embed.weight.norm()  # a normaliser that must not be differentiated
        h = torch.tanh(self.embed(positions) / norm + self.embed.bias.data)
        energy = self.out(F.silu(self.hidden(h))).sum() * self.scale * SCALE
        self.calls = self.calls + 1  # rebound, not updated in place
        return energy, -torch.autograd.grad(energy, positions, create_graph=True)[0]


def test_through_autograd_grad_plain_values_rebound_buffers_and_no_grad_act_as_in_eager():
    """Each was baked into the first capture or lost: an attribute or global changed later, a rebound buffer, the
    gradient through an op under `torch.no_grad()` or through `.data`."""
    global SCALE
    model = Scaled()
    eager = copy.deepcopy(model)
    cm = pipeline.jit(model, executors=["torch"], fallback="raise")
    positions, target = torch.randn(7, 3), torch.randn(7, 3)
    try:
        for scale, global_scale in ((1.0, 1.0), (3.0, 1.0), (3.0, 2.0)):
            model.scale = eager.scale = scale
            SCALE = global_scale
            results, expected = train_step(cm, positions, target), train_step(eager, positions, target)
            for got, want in zip(results, expected):
                torch.testing.assert_close(got, want)
    finally:
        SCALE = 1.0
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert model.calls.item() == eager.calls.item() == 3
    assert pipeline.compile_stats(cm).recompilations == 2


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


@pytest.mark.allow_fallback
def test_an_autograd_function_through_autograd_grad_runs_in_eager_loudly():
    """`make_fx` records an `autograd.Function`'s forward ops, not its backward: such a model runs in eager, warned."""
    class Quantized(Potential):
        def forward(self, positions):
            positions = positions.requires_grad_(True)
            energy = (self.embed(positions) * _StraightThrough.apply(self.out.weight.sum())).sum()
            return energy, -torch.autograd.grad(energy, positions, create_graph=True)[0]

    model = Quantized()
    eager = copy.deepcopy(model)
    cm = pipeline.jit(model, executors=["torch"])
    positions, target = torch.randn(7, 3), torch.randn(7, 3)
    with pytest.warns(pipeline.PipelineFallbackWarning, match="runs in eager: .*round runs without grad") as caught:
        train_step(cm, positions, target)
    assert len(caught) == 1
    train_step(eager, positions, target)
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    with pytest.raises(pipeline.PipelineFallbackError, match="autograd.Function"):
        pipeline.jit(Quantized(), executors=["torch"], fallback="raise")(positions.clone())


@pytest.mark.allow_fallback
def test_a_plain_tensor_attribute_through_autograd_grad_runs_in_eager_naming_the_fix():
    """A tensor read from an attribute (not a parameter or buffer) is not among the capture's inputs: loud eager run."""
    class Shifted(Potential):
        def forward(self, positions):
            positions = positions.requires_grad_(True)
            energy = self.out(torch.tanh(self.embed(positions + self.shift))).sum()
            return energy, -torch.autograd.grad(energy, positions, create_graph=True)[0]

    model = Shifted()
    model.shift = torch.randn(3)
    eager = copy.deepcopy(model)
    positions, target = torch.randn(7, 3), torch.randn(7, 3)
    with pytest.warns(pipeline.PipelineFallbackWarning, match="reads a tensor that is neither.*buffer or an argument"):
        train_step(cm := pipeline.jit(model, executors=["torch"]), positions, target)
    train_step(eager, positions, target)
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert any("neither a parameter" in f for f in pipeline.compile_stats(cm).fallbacks)


@dataclasses.dataclass
class _Config:
    scale: float = 1.0


class Configured(Potential):
    """Reads a config object's field and a list element; turns `requires_grad` on for the caller's tensor."""

    def __init__(self):
        super().__init__()
        self.config, self.coefficients = _Config(), [1.0]

    def forward(self, positions):
        positions.requires_grad_(True)  # in place, as force models do
        h = torch.tanh(self.embed(positions))
        energy = self.out(F.silu(self.hidden(h))).sum() * self.config.scale * self.coefficients[0]
        return energy, -torch.autograd.grad(energy, positions, create_graph=True)[0]


def test_through_autograd_grad_nested_values_and_requires_grad_act_as_in_eager():
    """A config object's field and a list element were baked into the first capture; the input's `requires_grad_()`
    inside forward did not reach the caller's tensor (no `positions.grad`)."""
    model = Configured()
    eager = copy.deepcopy(model)
    cm = pipeline.jit(model, executors=["torch"], fallback="raise")
    for change in (lambda m: None, lambda m: setattr(m.config, "scale", 3.0),
                   lambda m: m.coefficients.__setitem__(0, -2.0)):
        change(model), change(eager)
        positions = torch.randn(5, 3)
        reference = positions.clone()
        for (energy, forces), x in ((cm(positions), positions), (eager(reference), reference)):
            (energy + forces.square().sum()).backward()
            assert x.requires_grad
        torch.testing.assert_close(positions.grad, reference.grad)
        torch.testing.assert_close(model.embed.weight.grad, eager.embed.weight.grad)
    assert pipeline.compile_stats(cm).recompilations == 2


class DeeplyConfigured(Potential):
    """Reads a value four levels into its config, and a class attribute."""
    cutoff = 1.0

    def __init__(self):
        super().__init__()
        self.config = {"blocks": [{"act": _Config(scale=1.0)}]}

    def forward(self, positions):
        positions.requires_grad_(True)
        h = torch.tanh(self.embed(positions)) * self.config["blocks"][0]["act"].scale * self.cutoff
        energy = self.out(F.silu(self.hidden(h))).sum()
        return energy, -torch.autograd.grad(energy, positions, create_graph=True)[0]


def test_through_autograd_grad_deep_values_class_attributes_and_strides_act_as_in_eager():
    """A value deep in a config and a class attribute were keyed by identity or not at all (a stale compilation);
    a transposed input of the same shape reused the compilation made for a contiguous one."""
    model = DeeplyConfigured()
    eager = copy.deepcopy(model)
    cm = pipeline.jit(model, executors=["torch"], fallback="raise")
    changes = (lambda m: None, lambda m: setattr(m.config["blocks"][0]["act"], "scale", 3.0),
               lambda m: setattr(DeeplyConfigured, "cutoff", -2.0), lambda m: None)
    try:
        for i, change in enumerate(changes):
            change(model), change(eager)
            positions = torch.randn(3, 5).t() if i == 3 else torch.randn(5, 3)
            (e1, f1), (e2, f2) = cm(positions.clone()), eager(positions.clone())
            torch.testing.assert_close((e1, f1), (e2, f2))
    finally:
        DeeplyConfigured.cutoff = 1.0
    assert pipeline.compile_stats(cm).recompilations == 3


@pytest.mark.allow_fallback
def test_through_autograd_grad_a_config_that_refers_to_itself_runs_in_eager_loudly():
    model = DeeplyConfigured()
    model.config["self"] = model.config
    positions, cm = torch.randn(5, 3), pipeline.jit(model, executors=["torch"])
    with pytest.warns(pipeline.PipelineFallbackWarning, match="nested over 8 levels deep"):
        got = cm(positions.clone())
    torch.testing.assert_close(got, model(positions.clone()))
    torch.testing.assert_close(cm(positions.clone()), got)  # the next call: decided once, reported once
    assert len(pipeline.compile_stats(cm).fallbacks) == 1


def test_through_autograd_grad_a_closure_cell_is_read_at_each_call():
    def make(coefficient):
        def forces(positions):
            positions = positions.requires_grad_(True)
            energy = (positions * positions * coefficient[0]).sum()
            return -torch.autograd.grad(energy, positions, create_graph=True)[0]
        return forces

    coefficient = [2.0]
    forces = make(coefficient)
    cm, positions = pipeline.jit(forces, executors=["torch"], fallback="raise"), torch.randn(4, 3)
    for value in (2.0, 7.0):
        coefficient[0] = value
        torch.testing.assert_close(cm(positions.clone()), forces(positions.clone()))
