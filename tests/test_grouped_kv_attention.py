"""grouped_kv_attention: SDPA on k/v repeated per query head reads the grouped k/v instead."""
import copy

import pytest
import torch

import pipeline
from models import Llama, LlamaConfig
from transforms import grouped_kv_attention
from transforms.grouped_kv_attention import grouped_kv_attention_in

CONFIG = LlamaConfig(vocab=64, dim=64, layers=2, heads=8, kv_heads=2, hidden=96, max_seq=16)


def _captured(cm):
    return [t for t in pipeline.last_traces(cm) if t.level == "torch"]


def _sdpa_and_repeats(trace):
    nodes = list(trace.module.graph.nodes)
    sdpa = [n for n in nodes if "scaled_dot_product_attention" in str(n.target)]
    repeats = [n for n in nodes if "repeat_interleave" in str(n.target)]
    return sdpa, repeats


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_attention_on_grouped_kv_trains_like_eager(dtype, tol):
    """On the CPU (the pass is told to apply there), in half precision: the same loss and gradients
    as eager repeating k/v, and no repeat left in the trace."""
    torch.manual_seed(0)
    model = Llama(CONFIG).to(dtype)
    eager = copy.deepcopy(model)
    tokens = torch.randint(0, CONFIG.vocab, (2, 16))
    cm = pipeline.jit(model, executors=["torch"], transforms=[grouped_kv_attention(devices=("cpu",))])
    loss, expected = cm(tokens).float().square().mean(), eager(tokens).float().square().mean()
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=tol, rtol=tol)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad.float(), q.grad.float(), atol=tol, rtol=tol, msg=name)
    rewritten = next(t for t in _captured(cm) if t.provenance[-1].name == "grouped_kv_attention")
    sdpa, repeats = _sdpa_and_repeats(rewritten)
    assert len(sdpa) == CONFIG.layers and not repeats
    assert all(n.kwargs.get("enable_gqa") is True for n in sdpa)


def repeat_kv(x, n):  # Hugging Face's way of repeating k/v heads
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


@pytest.mark.parametrize("repeat", [repeat_kv, lambda x, n: x.repeat_interleave(n, dim=1)],
                         ids=["expand_reshape", "repeat_interleave"])
def test_both_ways_of_repeating_heads_become_grouped_kv(repeat):
    def attention(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, repeat(k, 4), repeat(v, 4), is_causal=True)

    q = torch.randn(2, 8, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    cm = pipeline.jit(attention, executors=["torch"], transforms=[grouped_kv_attention(devices=("cpu",))])
    out = cm(q, k, v)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    expected = attention(q, k, v)
    expected_grads = torch.autograd.grad(expected.float().square().sum(), (q, k, v))
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, atol=5e-2, rtol=2e-2)
    code = _captured(cm)[-1].module.code
    assert "enable_gqa = True" in code and "expand" not in code and "repeat_interleave" not in code, code


def test_left_alone_where_it_cannot_win():
    """fp32 (no fused kernel takes grouped k/v: SDPA would fall back to its math path), a device
    not listed (CUDA by default, so every CPU run here), and repeats that are not per head."""
    torch.manual_seed(0)
    tokens = torch.randint(0, CONFIG.vocab, (2, 16))
    for model, devices in [(Llama(CONFIG), ("cpu",)), (Llama(CONFIG).bfloat16(), ("cuda",))]:
        cm = pipeline.jit(model, executors=["torch"], transforms=[grouped_kv_attention(devices=devices)])
        cm(tokens)
        sdpa, repeats = _sdpa_and_repeats(_captured(cm)[-1])  # the pass ran and changed nothing
        assert len(repeats) == 2 * CONFIG.layers and not any(n.kwargs.get("enable_gqa") for n in sdpa)

    def repeated_sequence(q, k, v):  # repeats along the sequence, not the heads: not grouped k/v
        return torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, dim=2),
                                                                v.repeat_interleave(2, dim=2))

    q, k, v = (torch.randn(1, 4, 8, 16, dtype=torch.bfloat16) for _ in range(3))
    k, v = k[:, :, :4], v[:, :, :4]
    cm = pipeline.jit(repeated_sequence, executors=["torch"], transforms=[grouped_kv_attention(devices=("cpu",))])
    torch.testing.assert_close(cm(q, k, v), repeated_sequence(q, k, v))
    sdpa, repeats = _sdpa_and_repeats(_captured(cm)[-1])
    assert len(repeats) == 2 and not sdpa[0].kwargs.get("enable_gqa")


def test_the_compiler_applies_it_by_default_on_cuda_half_types_only():
    """No transform listed: the compiler's default call (CUDA devices) leaves a CPU model alone."""
    torch.manual_seed(0)
    cm = pipeline.jit(Llama(CONFIG).bfloat16(), executors=["torch"])
    cm(torch.randint(0, CONFIG.vocab, (2, 16)))
    assert not any(t.provenance[-1].name == "grouped_kv_attention" for t in _captured(cm))
    trace = _captured(cm)[0]
    assert grouped_kv_attention_in(trace) is trace
    assert grouped_kv_attention_in(trace, devices=("cpu",)) is not trace


def _run(fn, *transforms, dtype=torch.bfloat16, autocast=False):
    """`fn` jitted with `transforms` and the pass (on the CPU), checked against eager (under
    autocast to bf16 when asked); the code of its last torch-level trace."""
    q = torch.randn(2, 8, 16, 32, dtype=dtype)
    k, v = torch.randn(2, 2, 16, 32, dtype=dtype), torch.randn(2, 2, 16, 32, dtype=dtype)
    cm = pipeline.jit(fn, executors=["torch"], transforms=list(transforms) + [grouped_kv_attention(devices=("cpu",))])
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        expected = fn(q, k.clone(), v)
    torch.testing.assert_close(cm(q, k.clone(), v), expected, atol=2e-2, rtol=2e-2)
    assert not pipeline.compile_stats(cm).eager_fallbacks
    return _captured(cm)[-1].module.code


def test_keyword_arguments_are_read_like_positional_ones():
    def attention(q, k, v):
        k = torch.reshape(input=torch.unsqueeze(input=k, dim=2).expand(2, 2, 4, 16, 32), shape=(2, 8, 16, 32))
        v = torch.repeat_interleave(v, repeats=4, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(query=q, key=k, value=v)
    assert "enable_gqa = True" in _run(attention)


@pytest.mark.parametrize("write", ["the copy", "the source"])
def test_left_alone_when_k_is_written_in_place_before_the_attention(write):
    """The repeat is a copy: a write into it (or into k after it) before the attention reads it
    would make the grouped k differ from what the attention read."""
    def attention(q, k, v):
        kr, vr = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
        (kr if write == "the copy" else k).mul_(3.0)
        return torch.nn.functional.scaled_dot_product_attention(q, kr, vr)
    assert "enable_gqa" not in _run(attention)


def test_left_alone_when_the_repeats_are_made_without_grad():
    """k/v repeated under `torch.no_grad()`: the attention reading the grouped k/v would send gradients into them."""
    def attention(q, k, v):
        with torch.no_grad():
            kr, vr = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(q, kr, vr)
    assert "enable_gqa" not in _run(attention)


def test_applies_under_mixed_precision():
    """fp32 q/k/v under `mixed_precision`'s autocast: the attention runs in bf16, so grouped k/v pay."""
    from transforms import mixed_precision

    def attention(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, dim=1),
                                                                v.repeat_interleave(4, dim=1))
    assert "enable_gqa = True" in _run(attention, mixed_precision("bf16"), dtype=torch.float32, autocast=True)
    assert "enable_gqa" not in _run(attention, dtype=torch.float32)  # fp32 without autocast: left alone
