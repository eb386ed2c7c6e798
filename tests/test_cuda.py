"""GPU tests (run on the GPU machine: scripts/gpu.sh tests). Each executor alone and together,
forward and backward, against eager, on the Llama-style model and HF LlamaForCausalLM."""
import copy

import pytest
import torch

import pipeline
from helpers import require_executors
from models import Llama, LlamaConfig
from models.llama import next_token_loss

pytestmark = pytest.mark.cuda

CONFIG = LlamaConfig(vocab=512, dim=256, layers=2, heads=8, kv_heads=4, hidden=704, max_seq=128)


def llama_pair(dtype):
    torch.manual_seed(0)
    model = Llama(CONFIG).cuda().to(dtype)
    return model, copy.deepcopy(model)


def step(model, tokens):
    loss = next_token_loss(model(tokens), tokens)
    loss.backward()
    return loss


def assert_grads_close(a, b, rtol, atol):
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, (1e-4, 1e-5)), (torch.bfloat16, (5e-2, 2e-2))])
def test_inductor_on_cuda_trains_llama_like_eager(dtype, tol):
    model, eager = llama_pair(dtype)
    tokens = torch.randint(0, CONFIG.vocab, (2, 64), device="cuda")
    cm = pipeline.jit(model, executors=["inductor"])
    torch.testing.assert_close(step(cm, tokens), step(eager, tokens), rtol=tol[0], atol=tol[0])
    assert_grads_close(model, eager, *tol)
    assert {r.executor for r in pipeline.regions(cm)} == {"inductor"}


def test_torch_executor_on_cuda_is_bit_identical():
    model, eager = llama_pair(torch.float32)
    tokens = torch.randint(0, CONFIG.vocab, (2, 64), device="cuda")
    cm = pipeline.jit(model, executors=["torch"])
    with torch.no_grad():
        assert torch.equal(cm(tokens), eager(tokens))


def test_attention_reads_grouped_kv_by_default_in_bf16():
    """The compiler's default rewrite (transforms/grouped_kv_attention.py): SDPA on the grouped k/v
    with enable_gqa, the k/v repeats gone, the same loss and gradients as eager, which repeats."""
    model, eager = llama_pair(torch.bfloat16)
    tokens = torch.randint(0, CONFIG.vocab, (2, 64), device="cuda")
    cm = pipeline.jit(model, executors=["torch"])
    torch.testing.assert_close(step(cm, tokens), step(eager, tokens), rtol=2e-2, atol=2e-2)
    assert_grads_close(model, eager, 5e-2, 2e-2)
    rewritten = [t for t in pipeline.last_traces(cm) if t.provenance[-1].name == "grouped_kv_attention"]
    assert len(rewritten) == 1
    code = rewritten[0].module.code
    assert code.count("enable_gqa = True") == CONFIG.layers and "repeat_interleave" not in code


def test_profile_reports_device_time_per_region():
    model, _ = llama_pair(torch.bfloat16)
    cm = pipeline.jit(model, executors=["inductor"])
    tokens = torch.randint(0, CONFIG.vocab, (2, 64), device="cuda")
    table = pipeline.profile(cm, tokens)
    assert {r.stage for r in table} == {"forward", "backward"} and all(r.ms > 0 for r in table)


def hf_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704,
                                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).cuda()


def _executors(names):
    import executors
    out = []
    for n in names:
        if n == "te-fp8":
            out.append(executors.te.fp8())
        elif n == "te-fp8-delayed":
            from transformer_engine.common.recipe import DelayedScaling
            out.append(executors.te.fp8(DelayedScaling()))
        else:
            out.append(n)
    return out


@pytest.mark.parametrize("names", [["nvfuser"], ["te"], ["te", "nvfuser", "inductor"]])
def test_gpu_executors_train_llama_like_eager_in_bf16(names):
    require_executors(*names)
    model, eager = llama_pair(torch.bfloat16)
    tokens = torch.randint(0, CONFIG.vocab, (2, 64), device="cuda")
    cm = pipeline.jit(model, executors=_executors(names))
    torch.testing.assert_close(step(cm, tokens), step(eager, tokens), rtol=2e-2, atol=2e-2)
    assert_grads_close(model, eager, 1e-1, 2e-2)
    used = {r.executor for r in pipeline.regions(cm)}
    assert set(names) <= used, (used, str(pipeline.regions(cm)))


def test_te_nvfuser_inductor_route_ops_by_priority():
    require_executors("te", "nvfuser")
    model, _ = llama_pair(torch.bfloat16)
    cm = pipeline.jit(model, executors=["te", "nvfuser", "inductor"])
    step(cm, torch.randint(0, CONFIG.vocab, (2, 64), device="cuda"))
    table = pipeline.regions(cm)
    te_ops = {op for r in table if r.executor == "te" for op in r.ops}
    assert te_ops == {"pipeline_te.linear", "pipeline_te.linear_backward"}
    assert not any("linear" in op for r in table if r.executor != "te" for op in r.ops)
    assert any(r.executor == "nvfuser" and "rsqrt" in r.ops for r in table)


def test_autotune_races_nvfuser_and_inductor_on_cuda_and_trains_like_eager():
    """autotune=True: each kind of region both can take is timed with CUDA events at its first
    call and runs on the faster one; every such region shows both times; the step is eager's."""
    require_executors("nvfuser")
    model, eager = llama_pair(torch.bfloat16)
    tokens = torch.randint(0, CONFIG.vocab, (2, 64), device="cuda")
    cm = pipeline.jit(model, executors=["nvfuser", "inductor"], autotune=True)
    torch.testing.assert_close(step(cm, tokens), step(eager, tokens), rtol=2e-2, atol=2e-2)
    assert_grads_close(model, eager, 1e-1, 2e-2)
    table = pipeline.regions(cm)
    raced = [r for r in table if r.race]
    assert {r.stage for r in raced} == {"forward", "backward"}, str(table)
    assert all(set(r.race) == {"nvfuser", "inductor"} and r.executor in r.race for r in raced)
    assert all(min(r.race.values()) > 0 for r in raced)
    assert pipeline.compile_stats(cm).seconds["autotune (measuring)"] > 0


def test_autotune_times_the_gpus_work_not_the_launching():
    """A candidate slow to launch (3 ms of host work) but quick on the GPU is timed by its kernel;
    one with more GPU work is timed longer: the race compares kernels, as CUDA graphs replay them."""
    import time
    from executors.autotune import _median_ms
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def slow_to_launch(a):
        time.sleep(0.003)
        return a + 1

    def more_gpu_work(a):
        for _ in range(8):
            a = a @ a
        return a
    quick, _ = _median_ms(slow_to_launch, [x], [], True, lambda out: None)
    heavy, _ = _median_ms(more_gpu_work, [x], [], True, lambda out: None)
    assert quick < 1.0, f"{quick:.3f} ms: the host's 3 ms sleep was timed"
    assert heavy > quick


@pytest.mark.parametrize("exponent", [1, 2, 3, 0.5, -0.5, -1, 1.7])
def test_nvfuser_pow_by_a_scalar_matches_eager(exponent):
    """Small exponents become multiplies or roots in nvFuser; values and gradients stay eager's."""
    require_executors("nvfuser")

    def fn(x):
        return (x.pow(exponent) * 3).sum(-1)

    x = (torch.rand(64, 96, device="cuda") + 0.5).requires_grad_()
    cm = pipeline.jit(fn, executors=["nvfuser"])
    out = cm(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    x2 = x.detach().clone().requires_grad_()
    want = fn(x2)
    want.sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, x2.grad, rtol=1e-5, atol=1e-5)
    table = pipeline.regions(cm)
    assert {r.executor for r in table if r.stage == "forward"} == {"nvfuser"}, str(table)


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("grouped", [True, False])
def test_te_fp8_trains_close_to_bf16_and_reports_the_fp8_share(grouped):
    require_executors("te")
    import executors
    model, eager = llama_pair(torch.bfloat16)
    tokens = torch.randint(0, CONFIG.vocab, (2, 64), device="cuda")
    cm = pipeline.jit(model, executors=[executors.te.fp8().options(group_linears=grouped), "inductor"])
    loss, ref = step(cm, tokens), step(eager, tokens)
    assert abs(loss.item() - ref.item()) < 0.05 * ref.item()
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert relative_error(p.grad, q.grad) < 0.25, name
    assert pipeline.regions(cm).fp8_gemm_flop_share() == 1.0


def test_te_fp8_keeps_no_fp8_copies_for_the_backward():
    """The fp8 linear saves its bf16 x and W (kept or recomputed for other ops anyway) and casts them
    again in the backward, as torchao's float8 does: no fp8 transposes held from forward to backward."""
    require_executors("te")
    import executors
    model, _ = llama_pair(torch.bfloat16)
    tokens = torch.randint(0, CONFIG.vocab, (2, 64), device="cuda")
    cm = pipeline.jit(model, executors=[executors.te.fp8(), "inductor"])
    step(cm, tokens)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = cm(tokens).float().square().mean()
    loss.backward()
    assert saved and not [t for t in saved if t.dtype in (torch.uint8, torch.float8_e4m3fn)], \
        [(t.dtype, tuple(t.shape)) for t in saved if t.dtype == torch.uint8]
    assert pipeline.regions(cm).fp8_gemm_flop_share() == 1.0


def test_te_fp8_leaves_shapes_it_cannot_take_with_the_reason():
    require_executors("te")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 24), torch.nn.ReLU(), torch.nn.Linear(24, 32)).cuda().bfloat16()
    cm = pipeline.jit(model, executors=_executors(["te-fp8", "inductor"]))
    cm(torch.randn(32, 40, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    reasons = [why for _, op, why in pipeline.compile_stats(cm).op_fallbacks if op == "linear"]
    assert any("K=40" in why for why in reasons)


@pytest.mark.parametrize("names, dtype, loss_tol, grad_tol", [
    (["inductor"], torch.float32, 1e-4, (1e-3, 1e-5)),
    (["nvfuser"], torch.bfloat16, 2e-2, (1e-1, 2e-2)),
    (["te"], torch.bfloat16, 2e-2, (1e-1, 2e-2)),
    (["te", "nvfuser", "inductor"], torch.bfloat16, 2e-2, (1e-1, 2e-2))])
def test_executors_train_hf_llama_like_eager(names, dtype, loss_tol, grad_tol):
    require_executors(*names)
    model = hf_llama().to(dtype)
    eager = copy.deepcopy(model)
    tokens = torch.randint(0, 512, (2, 64), device="cuda")
    cm = pipeline.jit(model, executors=_executors(names))
    loss = cm(input_ids=tokens, labels=tokens).loss
    loss.backward()
    ref = eager(input_ids=tokens, labels=tokens).loss
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=loss_tol, atol=loss_tol)
    assert_grads_close(model, eager, *grad_tol)


def test_hf_llama_attention_is_causal_by_flag_on_grouped_kv():
    """HF's traced Llama hands SDPA a causal mask and repeated k/v; by default the pipeline runs it as
    eager HF does (causal_attention, then grouped_kv_attention): is_causal, enable_gqa, no mask."""
    model = hf_llama().bfloat16()
    eager = copy.deepcopy(model)
    tokens = torch.randint(0, 512, (2, 64), device="cuda")
    cm = pipeline.jit(model, executors=["inductor"])
    loss = cm(input_ids=tokens, labels=tokens).loss
    loss.backward()
    ref = eager(input_ids=tokens, labels=tokens).loss
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)
    assert_grads_close(model, eager, 1e-1, 2e-2)
    assert "inductor" in {r.executor for r in pipeline.regions(cm)} and not pipeline.compile_stats(cm).eager_fallbacks
    captured = [t for t in pipeline.last_traces(cm) if t.level == "torch"][-1]
    sdpa = [n for n in captured.module.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert len(sdpa) == 2 and {p.name for p in captured.provenance} >= {"causal_attention", "grouped_kv_attention"}
    assert all(n.kwargs.get("is_causal") is True and n.kwargs.get("enable_gqa") is True
               and n.kwargs.get("attn_mask") is None for n in sdpa), captured.module.code


@pytest.mark.parametrize("kind, tolerance", [("int8", 0.02), ("fp8", 0.08)])
def test_quantized_llama_on_cuda_is_close_to_full_precision(kind, tolerance):
    from transforms import quantize
    model, _ = llama_pair(torch.float32)
    model.eval()
    tokens = torch.randint(0, CONFIG.vocab, (2, 64), device="cuda")
    with torch.no_grad():
        reference = model(tokens)
    cm = pipeline.jit(model, executors=["inductor"], transforms=[quantize(kind)])
    with torch.no_grad():
        out = cm(tokens)
    assert ((out - reference).norm() / reference.norm()).item() < tolerance
    assert all(p.device.type == "cuda" for p in cm.parameters())


def test_te_fp8_delayed_scaling_trains_and_keeps_its_state_in_the_state_dict():
    require_executors("te")
    import executors
    from transformer_engine.common.recipe import DelayedScaling
    recipe = DelayedScaling(amax_history_len=16)
    model, eager = llama_pair(torch.bfloat16)
    cm = pipeline.jit(model, executors=[executors.te.fp8(recipe), "inductor"])
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, eager)]
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(4):
        tokens = torch.randint(0, CONFIG.vocab, (2, 64), device="cuda", generator=g)
        loss, ref = step(cm, tokens), step(eager, tokens)
        assert abs(loss.item() - ref.item()) < 0.05 * ref.item()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert pipeline.regions(cm).fp8_gemm_flop_share() == 1.0

    sd = cm.state_dict()
    # te groups q/k/v and gate/up by default: one state per group, under its first member
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and not n.endswith(("attn.wk", "attn.wv", "mlp.w3"))]
    fp8_keys = {k for k in sd if "._extra_state." in k}
    assert fp8_keys == {f"{n}._extra_state.weight_{s}" for n in linears for s in ("fp8_scale", "fp8_amax_history")}
    for n in linears:
        scale, history = sd[f"{n}._extra_state.weight_fp8_scale"], sd[f"{n}._extra_state.weight_fp8_amax_history"]
        assert scale.shape == (3,) and history.shape == (16, 3)
        assert (scale != 1).all() and (history.amax(0) > 0).all(), n   # x, W and dy scales all learned

    fresh = Llama(CONFIG).cuda().to(torch.bfloat16)  # an eager model ignores them with strict=False
    missing, unexpected = fresh.load_state_dict(sd, strict=False)
    assert not missing and set(unexpected) == fp8_keys

    again = pipeline.jit(fresh, executors=[executors.te.fp8(recipe), "inductor"])
    again.load_state_dict(sd)
    with torch.no_grad():  # the next call of each: the resumed model continues like the uninterrupted one
        again(tokens)
        cm(tokens)
    restored, continued = again.state_dict(), cm.state_dict()
    for k in fp8_keys:
        if "fp8_scale" in k or k.endswith("fp8_amax_history"):
            torch.testing.assert_close(restored[k], continued[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("names", [["inductor"], ["te-fp8-delayed", "inductor"], ["te", "nvfuser", "inductor"]])
def test_cuda_graphs_train_like_the_same_executors_without_them(names):
    """`cuda_graphs=True` records each stage once and replays it: four training steps (warm-up,
    record, two replays) give the losses and gradients of the same executors run region by region,
    and the replayed step launches CUDA graphs."""
    require_executors(*[n for n in names if n != "inductor"])
    model, plain_model = llama_pair(torch.bfloat16)
    graphed = pipeline.jit(model, executors=_executors(names), cuda_graphs=True)
    plain = pipeline.jit(plain_model, executors=_executors(names))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, plain_model)]
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, CONFIG.vocab, (2, 64), device="cuda", generator=g) for _ in range(2)]
    for i in range(4):
        loss, ref = step(graphed, batches[i % 2]).item(), step(plain, batches[i % 2]).item()
        assert abs(loss - ref) <= 1e-3 * abs(ref), (i, loss, ref)
        assert_grads_close(model, plain_model, 2e-2, 2e-3)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert set(pipeline.compile_stats(graphed).cuda_graphs.values()) == {"on"}, pipeline.compile_stats(graphed)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(graphed, batches[0])
        torch.cuda.synchronize()
    assert any(e.name == "cudaGraphLaunch" for e in prof.events())
