"""The `inductor` executor matches eager within fp32 tolerance (forward, gradients, buffers)."""
import pytest
import torch

import pipeline
from helpers import assert_same_grads, run_both
from models import LlamaBlock, LlamaConfig

pytestmark = pytest.mark.inductor


def test_mlp_inference(mlp):
    ref, out, _, cm = run_both(mlp, torch.randn(4, 16), executors=["inductor"])
    torch.testing.assert_close(out, ref)
    assert [r.executor for r in pipeline.regions(cm)] == ["inductor"]


def test_convbn_training_matches_eager_with_running_stats(convbn):
    ref, out, eager, cm = run_both(convbn, torch.randn(4, 3, 8, 8), executors=["inductor"], train=True)
    torch.testing.assert_close(out, ref)
    assert_same_grads(eager, cm, exact=False)
    torch.testing.assert_close(cm.bn.running_mean, eager.bn.running_mean)
    torch.testing.assert_close(cm.bn.running_var, eager.bn.running_var)
    assert int(cm.bn.num_batches_tracked) == 1
    assert {(r.stage, r.executor) for r in pipeline.regions(cm)} == {("forward", "inductor"),
                                                                      ("backward", "inductor")}


def test_llama_block_training_matches_eager():
    block = LlamaBlock(LlamaConfig())
    ref, out, eager, cm = run_both(block, torch.randn(2, 16, 64), executors=["inductor"], train=True)
    torch.testing.assert_close(out, ref)
    assert_same_grads(eager, cm, exact=False, rtol=1e-4, atol=1e-5)


def test_llama_model_training_matches_eager():
    from models import Llama
    model = Llama(LlamaConfig())
    tokens = torch.randint(0, 256, (2, 16))
    ref, out, eager, cm = run_both(model, tokens, executors=["inductor"], train=True)
    torch.testing.assert_close(out, ref)
    assert_same_grads(eager, cm, exact=False, rtol=1e-4, atol=1e-5)


def test_graph_break_function_matches_eager():
    from test_torch_executor import data_dependent
    cf = pipeline.jit(data_dependent, executors=["inductor"])
    x = torch.randn(16).abs() + 0.1
    torch.testing.assert_close(cf(x), data_dependent(x))
    torch.testing.assert_close(cf(-x), data_dependent(-x))
    assert pipeline.compile_stats(cf).graphs >= 2
