"""Dynamic shapes and the guards users hit: no needless recompiles, correct results, reasons shown."""
import copy

import pytest
import torch

import pipeline
from helpers import assert_same_grads
from models import LlamaBlock, LlamaConfig

SHAPES = [(3, 16), (5, 16), (8, 16), (16, 16), (64, 16), (4, 7), (4, 19), (4, 33)]


def run_shapes(cm, block):
    with torch.no_grad():
        for batch, seq in SHAPES:
            x = torch.randn(batch, seq, 64)
            torch.testing.assert_close(cm(x), block(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("executor", ["torch", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_dynamic_true_compiles_once_for_all_batch_and_sequence_sizes(executor):
    block = LlamaBlock(LlamaConfig()).eval()
    cm = pipeline.jit(block, executors=[executor], dynamic=True)
    run_shapes(cm, block)
    stats = pipeline.compile_stats(cm)
    assert stats.graphs == 1 and stats.recompilations == 0
    assert [r.executor for r in pipeline.regions(cm)] == [executor]  # one region, compiled once


def test_automatic_dynamic_recompiles_once_for_new_batch_then_sequence_sizes():
    block = LlamaBlock(LlamaConfig()).eval()
    cm = pipeline.jit(block, executors=["torch"])
    run_shapes(cm, block)  # batch 3, 5, 8, 16, 64, then sequence 7, 19, 33
    stats = pipeline.compile_stats(cm)
    assert stats.recompilations == 1 and "size mismatch at index 0" in stats.recompile_reasons[0]


def test_automatic_dynamic_keeps_the_feature_size_static():
    block = LlamaBlock(LlamaConfig()).eval()
    cm = pipeline.jit(block, executors=["torch"])
    run_shapes(cm, block)
    lowered = [t for t in pipeline.last_traces(cm) if t.name.endswith("_inference")][0]
    x_line = next(line for line in str(lowered).splitlines() if "user_input" in line)
    assert ": f32[s" in x_line and ", 64]" in x_line, x_line  # x: f32[s0, s1, 64]


def test_dtype_change_recompiles_and_names_the_failed_guard(mlp):
    cm = pipeline.jit(mlp.double(), executors=["torch"])
    cm(torch.randn(2, 16, dtype=torch.float64))
    mlp.float()
    cm(torch.randn(2, 16))
    stats = pipeline.compile_stats(cm)
    assert stats.recompilations == 1
    assert len(stats.recompile_reasons) == 1 and "dtype mismatch" in stats.recompile_reasons[0]
    assert "recompiled:" in str(stats)


def test_switching_train_and_eval_gives_eager_results(convbn):
    eager = copy.deepcopy(convbn)
    cm = pipeline.jit(convbn, executors=["torch"])
    x = torch.randn(4, 3, 8, 8)
    for mode in (True, False, True):
        cm.train(mode)
        eager.train(mode)
        with torch.no_grad():
            assert torch.equal(cm(x), eager(x))
    assert torch.equal(convbn.bn.running_mean, eager.bn.running_mean)
    assert pipeline.compile_stats(cm).recompilations >= 1


def test_no_grad_and_grad_calls_both_match_eager(mlp):
    eager = copy.deepcopy(mlp)
    cm = pipeline.jit(mlp, executors=["torch"])
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(cm(x), eager(x))
    cm(x).sum().backward()
    eager(x).sum().backward()
    assert_same_grads(eager, mlp)
    assert {r.stage for r in pipeline.regions(cm)} == {"inference", "forward", "backward"}


def test_freezing_a_parameter_is_respected(mlp):
    eager = copy.deepcopy(mlp)
    cm = pipeline.jit(mlp, executors=["torch"])
    x = torch.randn(4, 16)
    cm(x).sum().backward()
    for m in (mlp, eager):
        m.zero_grad(set_to_none=True)
        m.fc1.weight.requires_grad_(False)
    cm(x).sum().backward()
    eager(x).sum().backward()
    assert mlp.fc1.weight.grad is None
    assert_same_grads(eager, mlp)
