"""quantize("int8" | "fp8"): weight-only quantized linears, held quantized, state dicts both ways."""
import copy

import pytest
import torch

import pipeline
from models import Llama, LlamaConfig
from transforms import quantize


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def llama_and_tokens():
    model = Llama(LlamaConfig()).eval()
    return model, torch.randint(0, 256, (2, 16))


@pytest.mark.parametrize("executor", ["torch", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_int8_logits_within_two_percent_of_fp32(llama_and_tokens, executor):
    """With Inductor the dequantize is fused into its kernels: one region."""
    model, tokens = llama_and_tokens
    with torch.no_grad():
        reference = model(tokens)
    cm = pipeline.jit(model, executors=[executor], transforms=[quantize("int8")])
    with torch.no_grad():
        assert relative_error(cm(tokens), reference) < 0.02
    if executor == "inductor":
        assert [r.executor for r in pipeline.regions(cm)] == ["inductor"]


def test_linear_weights_are_held_in_int8(llama_and_tokens):
    model, _ = llama_and_tokens
    linear_bytes = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) * 4
    cm = pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")])
    params = dict(cm.named_parameters())
    quantized = {n: p for n, p in params.items() if n.endswith(".q")}
    assert len(quantized) == 15 and all(p.dtype == torch.int8 for p in quantized.values())
    assert sum(p.numel() * p.element_size() for p in quantized.values()) == linear_bytes // 4
    # the original module keeps only one-element stand-ins for those weights
    assert all(m.weight.untyped_storage().nbytes() <= 4 for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_dequantize_is_in_the_trace_not_done_at_load_time(llama_and_tokens):
    model, tokens = llama_and_tokens
    cm = pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")])
    with torch.no_grad():
        cm(tokens)
    lowered = next(t for t in pipeline.last_traces(cm) if t.name == "g0_inference")
    text = str(lowered)
    assert "i8[64, 64]" in text and "parameter 'layers.0.attn.wq.weight.q'" in text
    assert "aten._to_copy.default(layers_0_attn_wq_weight_q, dtype=torch.float32)" in text


def test_state_dict_round_trip_is_bit_identical(llama_and_tokens):
    model, tokens = llama_and_tokens
    cm = pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")])
    before = {n: p.detach().clone() for n, p in cm.named_parameters()}
    state = cm.state_dict()
    assert state["layers.0.attn.wq.weight"].dtype == torch.float32
    assert state["layers.0.attn.wq.weight"].shape == (64, 64)
    assert "layers.0.attn.wq._extra_state.weight_scale" in state
    cm.load_state_dict(state)
    for name, param in cm.named_parameters():
        assert torch.equal(param, before[name]), name


def test_an_edited_weight_loaded_with_its_old_scale_is_not_clipped(llama_and_tokens):
    """Rows that outgrew their saved scale get a fresh one (they were clamped to the old range); the others keep it."""
    model, _ = llama_and_tokens
    cm = pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")])
    state = cm.state_dict()
    key, scale_key = "layers.0.attn.wq.weight", "layers.0.attn.wq._extra_state.weight_scale"
    edited = state[key].clone()
    edited[:8] *= 4
    cm.load_state_dict({**state, key: edited})
    reloaded = cm.state_dict()
    assert relative_error(reloaded[key], edited) < 0.01
    assert torch.equal(reloaded[scale_key][8:], state[scale_key][8:])


def test_a_bf16_row_grown_by_less_than_bf16_noise_is_not_clipped_either():
    """A tolerance of bf16's own rounding (1.6%) kept the old scale for a row grown by one bf16 step and clipped it."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 2)).eval().to(torch.bfloat16)
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 0.5, -0.25, 0.125], [0.5, 0.5, 0.5, 0.5]]))
    cm = pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")])
    state = cm.state_dict()
    edited = state["0.weight"].clone()
    edited[0, 0] = 1 + 2 ** -7  # the next bf16 value after 1.0: 128.0 at the old scale, clipped to 127 before
    cm.load_state_dict({**state, "0.weight": edited})
    assert abs(cm.state_dict()["0.weight"][0, 0].item() - edited[0, 0].item()) <= (1 + 2 ** -7) / 127 / 2


@pytest.mark.parametrize("factor", [0.1, 0.002])
def test_a_weight_loaded_smaller_than_its_saved_scale_gets_its_own_scale(factor):
    """A row whose values shrank (rescaled, fine-tuned) kept its old, coarser scale: at 0.002 every weight became 0."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()
    cm = pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")])
    state = cm.state_dict()
    smaller = state["0.weight"] * factor
    cm.load_state_dict({**state, "0.weight": smaller})
    assert relative_error(cm.state_dict()["0.weight"], smaller) < 0.01


def test_state_dict_keys_are_the_originals_plus_one_scale_per_linear(llama_and_tokens):
    model, _ = llama_and_tokens
    original = set(model.state_dict())
    linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    cm = pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")])
    assert set(cm.state_dict()) == original | {f"{name}._extra_state.weight_scale" for name in linears}


def test_an_eager_model_loads_the_quantized_state_dict(llama_and_tokens):
    model, tokens = llama_and_tokens
    eager = copy.deepcopy(model)
    cm = pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")])
    eager.load_state_dict(cm.state_dict(), strict=False)  # _extra_state keys are ignored
    with torch.no_grad():
        torch.testing.assert_close(eager(tokens), cm(tokens), rtol=1e-5, atol=1e-5)


def test_a_full_precision_checkpoint_loads_into_a_quantized_model(llama_and_tokens, tmp_path):
    model, tokens = llama_and_tokens
    trained = Llama(LlamaConfig()).eval()
    cm = pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")])
    cm.load_state_dict(trained.state_dict())
    with torch.no_grad():
        assert relative_error(cm(tokens), trained(tokens)) < 0.02


def test_fp8_weights_are_held_in_fp8_and_close(llama_and_tokens):
    model, tokens = llama_and_tokens
    with torch.no_grad():
        reference = model(tokens)
    cm = pipeline.jit(model, executors=["torch"], transforms=[quantize("fp8")])
    assert {p.dtype for n, p in cm.named_parameters() if n.endswith(".q")} == {torch.float8_e4m3fn}
    with torch.no_grad():
        assert relative_error(cm(tokens), reference) < 0.08


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_half_precision_weights_dequantize_to_their_own_dtype(kind, dtype):
    """The dequantize computes in fp32 and casts back: it used to multiply by the fp32 scale and hand an fp32
    weight to a half-precision matmul (a dtype error at the first call)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval().to(dtype)
    x = torch.randn(8, 64, dtype=dtype)
    with torch.no_grad():
        reference = model(x)
        cm = pipeline.jit(model, executors=["torch"], transforms=[quantize(kind)])
        out = cm(x)
    assert out.dtype == dtype and cm.state_dict()["0.weight"].dtype == dtype
    assert relative_error(out.float(), reference.float()) < (0.02 if kind == "int8" else 0.08)


def test_a_model_without_linears_is_an_error_not_a_no_op():
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 2, 1)).eval()
    with pytest.raises(ValueError, match=r"quantize\(int8\) applies to no parameter of Sequential"):
        pipeline.jit(model, executors=["torch"], transforms=[quantize()])
    assert isinstance(model[0].weight, torch.nn.Parameter) and model[0].weight.abs().sum() > 0  # left as it was


def test_unknown_quantization_is_an_error():
    with pytest.raises(ValueError, match="kind must be one of"):
        quantize("int3")


def test_a_model_in_train_mode_is_refused_before_anything_changes():
    """Its weights would become frozen int8 tensors and only the biases would train."""
    model = Llama(LlamaConfig())  # train() mode, the default
    before = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"quantize\(int8\).*layers\.0\.attn\.wq\.weight \(its module is in "
                                         r"train\(\) mode\).*call model\.eval\(\)"):
        pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")])
    assert all(p is before[n] for n, p in model.named_parameters())  # none replaced


def test_a_linear_left_in_train_mode_is_named():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).eval()
    model[2].train()
    with pytest.raises(ValueError, match=r"2\.weight \(its module is in train\(\) mode\)") as info:
        pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")])
    assert "0.weight" not in str(info.value)
    assert model[2].weight.dtype == torch.float32 and model[0].weight.dtype == torch.float32


def test_an_eval_model_quantizes_and_keeps_training_what_it_leaves_alone():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).eval()
    cm = pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")])
    params = dict(cm.named_parameters())
    assert params["0.weight.q"].dtype == torch.int8 and not params["0.weight.q"].requires_grad
    assert params["0.bias"].requires_grad and params["1.weight"].requires_grad


def test_moving_the_model_moves_the_quantized_tensors(llama_and_tokens):
    model, tokens = llama_and_tokens
    reference = copy.deepcopy(model).double()
    cm = pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")]).double()
    params = dict(cm.named_parameters())
    assert params["head.weight.q"].dtype == torch.int8 and params["head.weight.scale"].dtype == torch.float64
    with torch.no_grad():
        out = cm(tokens)
        assert out.dtype == torch.float64
        assert relative_error(out, reference(tokens)) < 0.02


def test_a_transformed_model_that_cannot_compile_fails_loudly(llama_and_tokens, monkeypatch):
    import pipeline.compiler as compiler
    model, tokens = llama_and_tokens

    def broken(*args, **kwargs):
        raise NotImplementedError("no lowering for this construct")
    monkeypatch.setattr(compiler, "aot_module_simplified", broken)
    cm = pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")])
    with pytest.raises(Exception, match="cannot run in eager on the original parameters"):
        with torch.no_grad():
            cm(tokens)


def test_train_on_a_quantized_model_is_refused(llama_and_tokens):
    model, _ = llama_and_tokens
    cm = pipeline.jit(model.eval(), executors=["torch"], transforms=[quantize("int8")])
    with pytest.raises(RuntimeError, match=r"changed by \['quantize\(int8\)'\], whose tensors are frozen"):
        cm.train()
    cm.eval()  # allowed


def small_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3)).eval()


def test_the_original_model_called_after_jit_is_refused_not_run_on_its_stand_ins():
    """Its replaced parameters are zero stand-ins: `model(x)` (or a submodule of it) returned wrong values silently."""
    model, x = small_mlp(), torch.randn(2, 8)
    expected = model(x)
    cm = pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")])
    for call in (lambda: model(x), lambda: model[2](torch.randn(2, 6))):
        with pytest.raises(RuntimeError, match="replaced by a model transform and live in the jitted model"):
            call()
    assert relative_error(cm(x), expected) < 0.02  # the jitted model still runs them


def test_a_parameter_under_two_names_is_refused():
    """Tied weights or a shared submodule: replaced name by name they would come apart (one ran on a zero stand-in)."""
    model = small_mlp()
    model.append(model[0])  # 0 and 3 are one Linear
    with pytest.raises(ValueError, match=r"0.weight, 3.weight are one parameter"):
        pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")])


def test_a_model_whose_parameters_moved_into_a_jitted_model_is_refused():
    model = small_mlp()
    pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")])
    with pytest.raises(ValueError, match="replaced by an earlier jit's quantize"):
        pipeline.jit(model, executors=["torch"])


def test_load_state_dict_names_missing_and_wrongly_shaped_weights():
    cm = pipeline.jit(small_mlp(), executors=["torch"], transforms=[quantize("int8")])
    good = small_mlp().state_dict()
    lacking = {k: v for k, v in good.items() if k != "0.weight"}
    with pytest.raises(RuntimeError, match=r"missing keys \['0.weight'\]"):
        cm.load_state_dict(lacking)
    assert cm.load_state_dict(lacking, strict=False).missing_keys == ["0.weight"]
    with pytest.raises(RuntimeError, match=r"size mismatch for 0.weight.*\(1, 8\).*\(6, 8\)"):
        cm.load_state_dict({**good, "0.weight": torch.randn(1, 8)})  # copy_ would broadcast the row


def test_the_state_dict_under_a_parent_module_holds_the_weights():
    model = small_mlp()
    reference = copy.deepcopy(model).state_dict()
    parent = torch.nn.Module()
    parent.net = pipeline.jit(model, executors=["torch"], transforms=[quantize("int8")])
    state = parent.state_dict()
    assert state.keys() >= {f"net.{k}" for k in reference}
    for key, value in reference.items():
        torch.testing.assert_close(state[f"net.{key}"], value, rtol=0.02, atol=0.01, msg=key)
    assert parent.net.state_dict(prefix="p.").keys() == {f"p.{k}" for k in parent.net.state_dict()}
