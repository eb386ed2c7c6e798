"""With only the `torch` executor, pipeline.jit is bit-identical to eager."""
import pytest
import torch
import torch.nn as nn

import pipeline
from helpers import assert_same_grads, run_both
from models import Llama, LlamaBlock, LlamaConfig


def test_mlp_inference_is_bit_identical(mlp):
    ref, out, _, _ = run_both(mlp, torch.randn(4, 16))
    assert torch.equal(ref, out)


@pytest.mark.parametrize("train_mode", [True, False])
def test_convbn_is_bit_identical_and_updates_running_stats(convbn, train_mode):
    convbn.train(train_mode)
    ref, out, eager, jitted = run_both(convbn, torch.randn(4, 3, 8, 8))
    assert torch.equal(ref, out)
    for name, buf in eager.named_buffers():
        assert torch.equal(buf, dict(jitted.named_buffers())[name]), name
    assert int(jitted.bn.num_batches_tracked) == (1 if train_mode else 0)


def test_convbn_training_grads_are_bit_identical(convbn):
    ref, out, eager, jitted = run_both(convbn, torch.randn(4, 3, 8, 8), train=True)
    assert torch.equal(ref, out)
    assert_same_grads(eager, jitted)
    assert torch.equal(eager.bn.running_var, jitted.bn.running_var)


def test_llama_block_is_bit_identical():
    block = LlamaBlock(LlamaConfig())
    ref, out, _, _ = run_both(block, torch.randn(2, 16, 64))
    assert torch.equal(ref, out)


def test_llama_model_forward_and_grads_are_bit_identical():
    model = Llama(LlamaConfig())
    tokens = torch.randint(0, 256, (2, 16))
    ref, out, eager, jitted = run_both(model, tokens, train=True)
    assert torch.equal(ref, out)
    assert_same_grads(eager, jitted)
    stages = {r.stage for r in pipeline.regions(jitted)}
    assert stages == {"forward", "backward"}


def data_dependent(x):
    y = x.sin()
    if y.sum() > 0:
        y = y * 2
    return y.cos() + 1


def test_data_dependent_graph_break_runs_both_branches():
    cf = pipeline.jit(data_dependent, executors=["torch"])
    x = torch.randn(16).abs() + 0.1
    assert torch.equal(cf(x), data_dependent(x))
    assert torch.equal(cf(-x), data_dependent(-x))
    stats = pipeline.compile_stats(cf)
    assert stats.graphs >= 2
    assert any("Data-dependent" in r for r in stats.graph_breaks)


class Printing(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        print("hidden norm computed")
        return self.fc(h) * 2


def test_print_in_forward_breaks_the_graph_and_still_prints(capsys):
    model = Printing()
    ref, out, _, jitted = run_both(model, torch.randn(3, 8))
    assert torch.equal(ref, out)
    assert capsys.readouterr().out.count("hidden norm computed") == 2  # eager once, jitted once
    stats = pipeline.compile_stats(jitted)
    assert stats.graphs == 2 and len(stats.graph_breaks) == 1
    assert "print" in str(pipeline.explain(Printing(), torch.randn(3, 8))).lower() or \
        pipeline.explain(Printing(), torch.randn(3, 8)).graph_breaks


def add_into(x, acc):
    acc.add_(x)
    acc.mul_(0.5)
    return acc.sum()


def test_mutating_an_input_matches_eager():
    cf = pipeline.jit(add_into, executors=["torch"])
    x = torch.randn(5)
    acc_ref, acc = torch.ones(5), torch.ones(5)
    assert torch.equal(add_into(x, acc_ref), cf(x, acc))
    assert torch.equal(acc, acc_ref)
    outputs = pipeline.last_traces(cf)[-1].outputs
    assert outputs[0].kind == "mutated_input" and "acc" in outputs[0].target
