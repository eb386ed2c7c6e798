"""causal_attention: SDPA handed an explicit causal mask runs with is_causal=True (a default pass)."""
import pytest
import torch
import torch.nn.functional as F

import pipeline
from transforms import causal_attention, grouped_kv_attention
from transforms.causal_attention import causal_attention_in


def _sdpa(cm):
    """The SDPA calls of the last captured (torch-level) trace: what every default pass left."""
    trace = [t for t in pipeline.last_traces(cm) if t.level == "torch"][-1]
    return trace, [n for n in trace.module.graph.nodes if "scaled_dot_product_attention" in str(n.target)]


def _mask_as_hf_builds_it(b, length, device):  # transformers 5.17's sdpa_mask, traced
    q_idx = torch.arange(length, device=device)[None, None, :, None]
    kv_idx = torch.arange(length, device=device)[None, None, None, :]
    return (kv_idx <= q_idx).expand(b, -1, length, length)


def _additive(length, lowest):
    return torch.full((length, length), lowest).triu(1)


def _attention(make_mask):
    def attention(q, k, v):
        mask = make_mask(q)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype) if mask.dtype != torch.bool
                                              else mask)
    return attention


CAUSAL = {
    "bool, as HF builds it": lambda q: _mask_as_hf_builds_it(q.shape[0], q.shape[2], q.device),
    "bool, tril": lambda q: torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril(),
    "additive -inf": lambda q: _additive(q.shape[2], float("-inf")),
    "additive lowest": lambda q: _additive(q.shape[2], torch.finfo(torch.float32).min),
}


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3)]


def _check_like_eager(attention, cm):
    q, k, v = _inputs()
    out = cm(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = attention(q, k, v)
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", list(CAUSAL))
def test_causal_mask_becomes_the_flag(kind):
    """Each spelling of the causal mask: gone from the trace, is_causal=True, the mask's ops erased,
    forward and gradients as eager with the mask."""
    attention = _attention(CAUSAL[kind])
    cm = pipeline.jit(attention, executors=["torch"])
    _check_like_eager(attention, cm)
    assert not pipeline.compile_stats(cm).eager_fallbacks
    trace, (sdpa,) = _sdpa(cm)
    assert trace.provenance[-1].name in ("causal_attention", "grouped_kv_attention")
    assert any(p.name == "causal_attention" for p in trace.provenance)
    assert sdpa.kwargs.get("is_causal") is True and sdpa.kwargs.get("attn_mask") is None, trace.module.code
    assert len(sdpa.args) <= 3 or sdpa.args[3] is None
    code = trace.module.code
    assert "arange" not in code and "tril" not in code and "triu" not in code, code


NOT_CAUSAL = {
    "sliding window": lambda q: torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril() & torch.ones(
        q.shape[2], q.shape[2], dtype=torch.bool).triu(-3),
    "upper triangle": lambda q: torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(),
    "a bias on kept positions (ALiBi-like)": lambda q: _additive(q.shape[2], float("-inf")) - torch.arange(
        q.shape[2]).float()[None, :] * 0.1,
    "from an input (padding)": lambda q: (q[:, :1, :, :1] > -10).expand(-1, -1, -1, q.shape[2]) & torch.ones(
        q.shape[2], q.shape[2], dtype=torch.bool).tril(),
    "random": lambda q: torch.ones(q.shape[2], q.shape[2]).tril().bernoulli().bool(),
}


@pytest.mark.parametrize("kind", list(NOT_CAUSAL))
def test_other_masks_are_left_alone(kind):
    attention = _attention(NOT_CAUSAL[kind])
    cm = pipeline.jit(attention, executors=["torch"])
    if kind != "random":
        _check_like_eager(attention, cm)
    else:
        cm(*_inputs())
    trace, (sdpa,) = _sdpa(cm)
    assert all(p.name != "causal_attention" for p in trace.provenance)
    mask = sdpa.kwargs.get("attn_mask", sdpa.args[3] if len(sdpa.args) > 3 else None)
    assert mask is not None and not sdpa.kwargs.get("is_causal")


def test_a_trace_without_masks_is_returned_as_is():
    cm = pipeline.jit(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), executors=["torch"])
    cm(*_inputs())
    trace = [t for t in pipeline.last_traces(cm) if t.level == "torch"][0]
    assert causal_attention_in(trace) is trace


@pytest.mark.parametrize("family", ["Llama", "Qwen2"])
def test_hf_models_run_causal_by_flag_and_grouped(family):
    """Hugging Face's Llama and Qwen2 (q/k/v biases; transformers materializes the causal mask and
    repeats k/v when traced): after the default passes (grouped k/v applied on the CPU here) their
    attention is causal by flag on grouped k/v, as the model runs eagerly."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, family + "Config")(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, family + "ForCausalLM")(config).bfloat16()
    tokens = torch.randint(0, 64, (2, 16))
    expected = model(input_ids=tokens, labels=tokens).loss
    expected.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    cm = pipeline.jit(lambda t: model(input_ids=t, labels=t).loss, executors=["torch"],
                      transforms=[pipeline.without("causal_attention", "grouped_kv_attention"),  # as on CUDA:
                                  causal_attention(), grouped_kv_attention(devices=("cpu",))])
    loss = cm(tokens)
    loss.backward()
    torch.testing.assert_close(loss, expected, atol=2e-2, rtol=2e-2)
    for p, e in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad.float(), e.float(), atol=2e-2, rtol=5e-2)
    assert not pipeline.compile_stats(cm).eager_fallbacks
    trace, sdpa = _sdpa(cm)
    assert len(sdpa) == 2, trace.module.code
    for n in sdpa:
        assert n.kwargs.get("is_causal") is True and n.kwargs.get("attn_mask") is None, trace.module.code
        assert n.kwargs.get("enable_gqa") is True, trace.module.code


def test_a_mask_too_large_to_compute_at_compile_time_is_left(monkeypatch):
    import sys
    monkeypatch.setattr(sys.modules["transforms.causal_attention"], "_LARGEST", 100)  # 16 x 16 masks
    attention = _attention(CAUSAL["bool, tril"])
    cm = pipeline.jit(attention, executors=["torch"], cache=False)
    _check_like_eager(attention, cm)
    trace, (sdpa,) = _sdpa(cm)
    assert all(p.name != "causal_attention" for p in trace.provenance)


def _writes_after_building(q):  # an in-place edit of a constant mask after it is built
    m = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    m[0, 1] = True
    return m


def _padding_written_in(q):  # older HF: the causal mask cloned, padding written into it in place
    m = torch.full((q.shape[2], q.shape[2]), float("-inf")).triu(1).expand(q.shape[0], 1, -1, -1).clone()
    m[:, :, :, :2] = m[:, :, :, :2].masked_fill(q[:, :1, :1, :2] > 0, float("-inf"))
    return m


def _tril_in_place(q):
    base = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool)
    return base.tril_()


WRITTEN = {"setitem after building": _writes_after_building, "padding written in": _padding_written_in,
           "tril_": _tril_in_place}


@pytest.mark.parametrize("kind", list(WRITTEN))
def test_a_mask_written_in_place_is_left_alone(kind):
    """What an in-place write makes of a mask is not what its ancestors compute: never rewritten."""
    attention = _attention(WRITTEN[kind])
    cm = pipeline.jit(attention, executors=["torch"], cache=False)
    _check_like_eager(attention, cm)
    trace, (sdpa,) = _sdpa(cm)
    assert all(p.name != "causal_attention" for p in trace.provenance), trace.module.code


def test_a_tensor_written_in_place_and_read_elsewhere_keeps_its_write():
    def f(q, k, v):
        base = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=base.tril_())
        return out + base.float().sum()

    cm = pipeline.jit(f, executors=["torch"], cache=False)
    _check_like_eager(f, cm)


def test_one_mask_read_at_two_lengths_is_decided_per_attention():
    """A [1, 1] mask is causal for one query and key position, not for eight."""
    def f(q1, k1, v1, q, k, v):
        m = torch.ones(1, 1, dtype=torch.bool)
        one = F.scaled_dot_product_attention(q1, k1, v1, attn_mask=m)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m) + one.sum()

    torch.manual_seed(0)
    args = [torch.randn(1, 2, 1, 4) for _ in range(3)] + [torch.randn(1, 2, 8, 4) for _ in range(3)]
    cm = pipeline.jit(f, executors=["torch"], cache=False)
    torch.testing.assert_close(cm(*args), f(*args))


@pytest.mark.parametrize("lengths", [(4, 8), (8, 4)])
def test_query_and_key_lengths_may_differ(lengths):
    """SDPA's flag is the upper-left `ones(L, S).tril()`, which the mask must equal."""
    length, keys = lengths

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(length, keys, dtype=torch.bool).tril())

    torch.manual_seed(0)
    args = [torch.randn(2, 4, length, 8)] + [torch.randn(2, 4, keys, 8) for _ in range(2)]
    cm = pipeline.jit(f, executors=["torch"], cache=False)
    torch.testing.assert_close(cm(*args), f(*args))
    _, (sdpa,) = _sdpa(cm)
    assert sdpa.kwargs.get("is_causal") is True


def test_only_masks_of_the_attentions_shape_are_computed():
    """Checked on the fake values before computing anything: [.., L, S], bool or float, leading dims
    1 or the query's (a mask over more batches would broadcast SDPA's output to them)."""
    import sys
    fits = sys.modules["transforms.causal_attention"]._fits
    q, k = torch.empty(1, 4, 16, 8), torch.empty(1, 4, 16, 8)
    for shape, dtype, expected in [((16, 16), torch.bool, True), ((1, 1, 16, 16), torch.float32, True),
                                   ((4, 16, 16), torch.bool, True), ((2, 1, 16, 16), torch.bool, False),
                                   ((3, 16, 16), torch.bool, False), ((16, 8), torch.bool, False),
                                   ((16, 16), torch.int64, False), ((1, 1, 1, 16, 16), torch.bool, False)]:
        assert fits(torch.empty(shape, dtype=dtype), q, k) is expected, (shape, dtype)


def test_a_half_precision_additive_mask_becomes_the_flag():
    def f(q, k, v):
        mask = torch.full((16, 16), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16).triu(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    torch.manual_seed(0)
    args = [torch.randn(2, 4, 16, 8, dtype=torch.bfloat16) for _ in range(3)]
    cm = pipeline.jit(f, executors=["torch"], cache=False)
    torch.testing.assert_close(cm(*args), f(*args), atol=2e-2, rtol=2e-2)
    _, (sdpa,) = _sdpa(cm)
    assert sdpa.kwargs.get("is_causal") is True
