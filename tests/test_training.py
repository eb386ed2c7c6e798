"""Training through pipeline.jit: dropout under a seed, optimizers, several steps against eager."""
import copy

import pytest
import torch
import torch.nn as nn

import pipeline
from executors import inductor
from helpers import assert_same_grads
from models import Llama, LlamaConfig
from models.llama import next_token_loss


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop, self.out = nn.Linear(16, 32), nn.Dropout(0.3), nn.Linear(32, 4)

    def forward(self, x):
        return self.out(self.drop(torch.relu(self.fc(x))))


def dropout_step(model, x, seed=1):
    torch.manual_seed(seed)
    out = model(x)
    out.sum().backward()
    return out


def test_dropout_is_identical_to_eager_under_the_same_seed_with_torch_executor():
    model = DropoutNet()
    eager = copy.deepcopy(model)
    cm = pipeline.jit(model, executors=["torch"])
    x = torch.randn(8, 16)
    assert torch.equal(dropout_step(cm, x), dropout_step(eager, x))
    assert_same_grads(eager, model)


@pytest.mark.inductor
def test_dropout_is_identical_to_eager_with_inductor_fallback_random():
    model = DropoutNet()
    eager = copy.deepcopy(model)
    cm = pipeline.jit(model, executors=[inductor.options(fallback_random=True)])
    x = torch.randn(8, 16)
    assert torch.equal(dropout_step(cm, x), dropout_step(eager, x))
    assert_same_grads(eager, model, exact=False)


def test_eval_mode_disables_dropout():
    cm = pipeline.jit(DropoutNet().eval(), executors=["torch"])
    x = torch.randn(8, 16)
    with torch.no_grad():
        assert torch.equal(cm(x), cm(x))


@pytest.mark.parametrize("fused", [False, True])
def test_adamw_training_follows_eager_for_several_steps(fused):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=1))
    eager = copy.deepcopy(model)
    cm = pipeline.jit(model, executors=["torch"])
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused) for m in (cm, eager)]
    tokens = torch.randint(0, 256, (2, 16))
    for _ in range(4):
        losses = []
        for m, opt in zip((cm, eager), opts):
            loss = next_token_loss(m(tokens), tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        assert torch.equal(losses[0], losses[1])
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert torch.equal(p, q), name
