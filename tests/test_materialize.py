"""materialize: a model built on the meta device gets storage at jit time, from its init or a file."""
import warnings
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

import pipeline
from helpers import recording_safe_open
from models import Llama, LlamaConfig
from ir import PipelineWarning
from transforms import materialize, quantize


def meta_llama():
    with torch.device("meta"):
        return Llama(LlamaConfig())


def test_meta_model_is_initialised_by_its_own_init_code():
    model = meta_llama()
    cm = pipeline.jit(model, executors=["torch"], transforms=[materialize()])
    assert all(p.device.type == "cpu" for p in cm.parameters())
    reference = Llama(LlamaConfig())
    assert torch.equal(model.layers[0].cos, reference.layers[0].cos)      # buffers recomputed
    assert torch.equal(model.norm.weight, torch.ones(64))                 # RMSNorm init
    assert model.head.weight.std() > 0                                    # nn.Linear init ran
    with torch.no_grad():
        assert torch.isfinite(cm(torch.randint(0, 256, (2, 16)))).all()


class TiedEmbedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return torch.nn.functional.cross_entropy(self.head(self.embed(tokens)).flatten(0, 1), tokens.flatten())


@pytest.mark.parametrize("from_file", [False, True])
def test_tied_weights_stay_tied(tmp_path, from_file):
    """They became two parameters (and trained apart from eager's one), with the file's values or initialised."""
    torch.manual_seed(0)
    eager = TiedEmbedding()
    path = str(tmp_path / "tied.safetensors")
    save_file({k: v.detach().clone() for k, v in eager.state_dict().items()}, path)
    with torch.device("meta"):
        model = TiedEmbedding()
    cm = pipeline.jit(model, executors=["torch"], transforms=[materialize(path if from_file else None)])
    assert model.head.weight is model.embed.weight and len(list(cm.parameters())) == 1
    if not from_file:
        return
    steps = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, cm)]
    tokens = torch.randint(0, 10, (2, 5))
    for _ in range(3):
        for m, optimizer in zip((eager, cm), steps):
            m(tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
    torch.testing.assert_close(model.head.weight, eager.head.weight)


def test_meta_model_loads_a_checkpoint_tensor_by_tensor(tmp_path):
    trained = Llama(LlamaConfig()).eval()
    path = str(tmp_path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, path)
    requested = []
    model = meta_llama().eval()
    with mock.patch("safetensors.safe_open", recording_safe_open(requested)):
        cm = pipeline.jit(model, executors=["torch"], transforms=[materialize(path)])
    assert sorted(key for key, _ in requested) == sorted(trained.state_dict())
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(cm(tokens), trained(tokens))


def test_checkpoint_missing_a_tensor_is_an_error(tmp_path):
    trained = Llama(LlamaConfig())
    state = {k: v.contiguous() for k, v in trained.state_dict().items() if k != "head.weight"}
    path = str(tmp_path / "partial.safetensors")
    save_file(state, path)
    with pytest.raises(KeyError, match="head.weight"):
        pipeline.jit(meta_llama(), executors=["torch"], transforms=[materialize(path)])


def test_materialize_then_quantize_holds_int8_weights():
    model = meta_llama().eval()
    cm = pipeline.jit(model, executors=["torch"], transforms=[materialize(), quantize("int8")])
    assert {p.dtype for n, p in cm.named_parameters() if n.endswith(".q")} == {torch.int8}
    with torch.no_grad():
        assert torch.isfinite(cm(torch.randint(0, 256, (2, 16)))).all()


def saved(tmp_path, state, name="model.safetensors"):
    path = str(tmp_path / name)
    save_file({k: v.contiguous() for k, v in state.items()}, path)
    return path


def pipeline_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, PipelineWarning)]


def test_a_float64_checkpoint_is_cast_with_one_warning_naming_the_tensors(tmp_path):
    trained = Llama(LlamaConfig()).double()
    path = saved(tmp_path, trained.state_dict())
    with pytest.warns(PipelineWarning) as record:
        cm = pipeline.jit(meta_llama(), executors=["torch"], transforms=[materialize(path)])
    [message] = pipeline_warnings(record)
    assert "21 tensors" in message and "embed.weight (torch.float64 -> torch.float32)" in message
    assert all(p.dtype == torch.float32 for p in cm.parameters())
    assert torch.equal(dict(cm.named_parameters())["head.weight"], trained.head.weight.float())


def test_keys_that_match_nothing_are_named_in_a_warning(tmp_path):
    trained = Llama(LlamaConfig())
    path = saved(tmp_path, {**trained.state_dict(), "head.wieght": torch.zeros(1), "extra.scale": torch.ones(2)})
    with pytest.warns(PipelineWarning, match=r"2 keys match no parameter.*extra\.scale, head\.wieght") as record:
        cm = pipeline.jit(meta_llama(), executors=["torch"], transforms=[materialize(path)])
    assert len(pipeline_warnings(record)) == 1 and "pipeline.save" not in pipeline_warnings(record)[0]
    assert torch.equal(dict(cm.named_parameters())["head.weight"], trained.head.weight)


def test_a_pipeline_save_file_is_refused_with_a_hint_to_use_pipeline_load(tmp_path):
    trained = Llama(LlamaConfig())
    path = str(tmp_path / "saved.safetensors")
    pipeline.save(pipeline.jit(trained, executors=["torch"]), path)
    with pytest.raises(KeyError, match=r"lacks embed\.weight.*written by pipeline\.save.*'model\.'.*pipeline\.load"):
        pipeline.jit(meta_llama(), executors=["torch"], transforms=[materialize(path)])


def test_a_checkpoint_loads_into_a_model_not_on_meta(tmp_path):
    """materialize(path) on a real model still takes the file's values, not silently its own."""
    trained = Llama(LlamaConfig())
    path = saved(tmp_path, trained.state_dict())
    cm = pipeline.jit(Llama(LlamaConfig()), executors=["torch"], transforms=[materialize(path)])
    for name, param in cm.named_parameters():
        assert torch.equal(param, trained.get_parameter(name)), name


def test_quantize_reading_a_float64_file_warns_and_quantizes_the_weights_from_it(tmp_path):
    trained = Llama(LlamaConfig()).double()
    path = saved(tmp_path, trained.state_dict())
    model = meta_llama().eval()
    with pytest.warns(PipelineWarning) as record:
        cm = pipeline.jit(model, executors=["torch"], transforms=[materialize(path), quantize("int8")])
    text = " ".join(pipeline_warnings(record))
    assert "layers.0.attn.wq.weight (torch.float64 -> torch.float32)" in text  # read by quantize
    assert "embed.weight (torch.float64 -> torch.float32)" in text             # read by materialize
    expected = quantize("int8").encode(trained.head.weight.float())["q"]
    assert torch.equal(dict(cm.named_parameters())["head.weight.q"], expected)


def test_quantize_reading_a_file_that_lacks_a_weight_names_it_and_changes_nothing(tmp_path):
    state = {k: v for k, v in Llama(LlamaConfig()).state_dict().items() if k != "head.weight"}
    path = saved(tmp_path, state)
    model = meta_llama().eval()
    with pytest.raises(KeyError, match=r"lacks head\.weight"):
        pipeline.jit(model, executors=["torch"], transforms=[materialize(path), quantize("int8")])
    assert all(p.is_meta for p in model.parameters())


def test_a_buffer_computed_in_init_and_left_unset_by_reset_parameters_is_named():
    """It used to come back as uninitialised memory: a rotary table of garbage, used silently."""
    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(4) / 4))

        def reset_parameters(self):
            pass  # initialises nothing of its own: inv_freq stays as __init__ left it, on meta

        def forward(self, x):
            return self.proj(x) * self.inv_freq

    with torch.device("meta"):
        model = Rotary()
    with pytest.raises(ValueError, match=r"reset_parameters\(\) left inv_freq unset"):
        pipeline.jit(model, executors=["torch"], transforms=[materialize()])


class _Tables(torch.nn.Module):
    """A weight the checkpoint holds, and tables computed in __init__ that only `reset_parameters` can rebuild."""
    def __init__(self, sets=("w", "freqs", "positions")):
        super().__init__()
        self.sets = sets
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.register_buffer("freqs", torch.polar(torch.ones(4), torch.arange(4.0)), persistent=False)
        self.register_buffer("positions", torch.arange(4), persistent=False)

    def reset_parameters(self):
        if "w" in self.sets:
            torch.nn.init.normal_(self.w)
        if "half of w" in self.sets:
            self.w[:2].zero_()
        if "freqs" in self.sets:
            self.freqs.copy_(torch.polar(torch.ones(4), torch.arange(4.0)))
        if "positions" in self.sets:
            self.positions.copy_(torch.arange(4))

    def forward(self, x):
        return (x @ self.w) * self.freqs.real + self.positions


@pytest.mark.parametrize("sets, unset", [(("half of w", "freqs", "positions"), "w"), (("w", "positions"), "freqs"),
                                         (("w", "freqs"), "positions")])
def test_a_tensor_reset_parameters_leaves_unset_in_part_complex_or_integer_is_named(sets, unset):
    with torch.device("meta"):
        model = _Tables(sets)
    with pytest.raises(ValueError, match=rf"reset_parameters\(\) left {unset} unset"):
        pipeline.jit(model, executors=["torch"], transforms=[materialize()])


class _Masked(torch.nn.Module):
    """A causal mask of bools computed in __init__: bools have no value to poison them with."""
    def __init__(self, how: str):
        super().__init__()
        self.how, self.w = how, torch.nn.Parameter(torch.randn(4, 4))
        self.register_buffer("causal", torch.ones(4, 4, dtype=torch.bool).tril(), persistent=False)

    def reset_parameters(self):
        torch.nn.init.normal_(self.w)
        if self.how == "copy":
            self.causal.copy_(torch.ones(4, 4, dtype=torch.bool).tril())
        elif self.how == "replace":
            self.causal = torch.ones(4, 4, dtype=torch.bool).tril()

    def forward(self, x):
        return (x @ self.w).masked_fill(~self.causal, 0.0)


def test_a_bool_buffer_reset_parameters_leaves_unset_is_named():
    """It came back as uninitialised memory (a mask of garbage, used silently): a bool has no value that marks it
    unset, so materialize asks whether anything wrote it or replaced it."""
    with torch.device("meta"):
        model = _Masked("forget")
    with pytest.raises(ValueError, match=r"reset_parameters\(\) left causal unset"):
        pipeline.jit(model, executors=["torch"], transforms=[materialize()])
    for how in ("copy", "replace"):
        with torch.device("meta"):
            model = _Masked(how)
        cm = pipeline.jit(model, executors=["torch"], transforms=[materialize()], fallback="raise")
        assert torch.equal(model.causal, torch.ones(4, 4, dtype=torch.bool).tril())
        x = torch.randn(4, 4)
        torch.testing.assert_close(cm(x), (x @ model.w).masked_fill(~model.causal, 0.0))


def test_a_table_reset_parameters_fills_with_both_infinities_is_not_taken_for_unset():
    """The unset check sums each tensor first; +inf and -inf sum to NaN, so a NaN sum is confirmed element-wise."""
    class Bounds(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("bounds", torch.tensor([float("-inf"), float("inf")]), persistent=False)

        def reset_parameters(self):
            self.bounds.copy_(torch.tensor([float("-inf"), float("inf")]))

        def forward(self, x):
            return x.clamp(*self.bounds)

    with torch.device("meta"):
        model = Bounds()
    assert pipeline.jit(model, executors=["torch"], transforms=[materialize()])(torch.ones(2)).tolist() == [1.0, 1.0]


def test_with_a_checkpoint_reset_parameters_owes_only_what_the_file_cannot_hold(tmp_path):
    """The file gives `w`: a `reset_parameters` that rebuilds only the non-persistent tables is enough."""
    eager = _Tables()
    save_file({"w": eager.w.detach()}, path := str(tmp_path / "w.safetensors"))
    with torch.device("meta"):
        model = _Tables(sets=("freqs", "positions"))
    x = torch.randn(2, 4)
    cm = pipeline.jit(model, executors=["torch"], transforms=[materialize(path)])
    torch.testing.assert_close(cm(x), eager(x))


def test_materialize_listed_twice_is_an_error(tmp_path):
    with torch.device("meta"):
        model = Llama(LlamaConfig())
    with pytest.raises(ValueError, match="list materialize once, not 2 times"):
        pipeline.jit(model, executors=["torch"], transforms=[materialize(), materialize(str(tmp_path / "w.st"))])


def test_a_model_with_its_own_init_weights_is_warned_that_reset_parameters_ran_instead():
    """Its `apply(self._init_weights)` in __init__ ran on meta: materialize() initialises otherwise, not silently."""
    class Custom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.apply(self._init_weights)

        def _init_weights(self, module):
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.normal_(module.weight, std=0.02)

        def forward(self, x):
            return self.proj(x)

    with torch.device("meta"):
        model = Custom()
    with pytest.warns(PipelineWarning, match=r"Custom._init_weights ran on the meta device only"):
        cm = pipeline.jit(model, executors=["torch"], transforms=[materialize()])
    assert cm(torch.randn(2, 4)).isfinite().all()
    with warnings.catch_warnings():  # nothing on meta: nothing to warn about
        warnings.simplefilter("error")
        pipeline.jit(Custom(), executors=["torch"], transforms=[materialize()])
