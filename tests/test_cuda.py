"""GPU tests (run on the GPU machine: scripts/gpu.sh tests). Each executor alone and together,
forward and backward, against eager, on the Llama-style model and HF LlamaForCausalLM."""
import copy

import pytest
import torch

import pipeline
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


def test_inductor_trains_hf_llama_like_eager():
    model = hf_llama()
    eager = copy.deepcopy(model)
    tokens = torch.randint(0, 512, (2, 64), device="cuda")
    cm = pipeline.jit(model, executors=["inductor"])
    loss = cm(input_ids=tokens, labels=tokens).loss
    loss.backward()
    ref = eager(input_ids=tokens, labels=tokens).loss
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-4)
    assert_grads_close(model, eager, 1e-3, 1e-5)
