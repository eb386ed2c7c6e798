"""pipeline.save / pipeline.load: model and optimizer state through safetensors."""
import copy

import pytest
import torch
from safetensors.torch import load_file

import pipeline
from models import Llama, LlamaConfig
from models.llama import next_token_loss


def train(model, opt, tokens, steps):
    for _ in range(steps):
        next_token_loss(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()


def test_saved_model_loads_into_an_eager_copy_with_identical_tensors(tmp_path):
    model = Llama(LlamaConfig())
    cm = pipeline.jit(model, executors=["torch"])
    opt = torch.optim.AdamW(cm.parameters(), lr=1e-2)
    train(cm, opt, torch.randint(0, 256, (2, 16)), steps=2)
    pipeline.save(cm, str(tmp_path / "ckpt.safetensors"))
    fresh = Llama(LlamaConfig())
    state = {k.removeprefix("model."): v for k, v in load_file(str(tmp_path / "ckpt.safetensors")).items()}
    fresh.load_state_dict(state)
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name


def test_training_resumes_identically_from_a_checkpoint(tmp_path):
    tokens = torch.randint(0, 256, (2, 16))
    model = Llama(LlamaConfig(layers=1))
    cm = pipeline.jit(model, executors=["torch"])
    opt = torch.optim.AdamW(cm.parameters(), lr=1e-2)
    train(cm, opt, tokens, steps=2)
    path = str(tmp_path / "ckpt.safetensors")
    pipeline.save(cm, path, optimizer=opt)

    resumed = Llama(LlamaConfig(layers=1))
    resumed_cm = pipeline.jit(resumed, executors=["torch"])
    resumed_opt = torch.optim.AdamW(resumed_cm.parameters(), lr=1e-2)
    pipeline.load(resumed_cm, path, optimizer=resumed_opt)
    train(cm, opt, tokens, steps=2)
    train(resumed_cm, resumed_opt, tokens, steps=2)
    for (name, a), (_, b) in zip(model.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name


def test_loading_optimizer_state_from_a_model_only_file_is_an_error(tmp_path, mlp):
    cm = pipeline.jit(mlp, executors=["torch"])
    path = str(tmp_path / "m.safetensors")
    pipeline.save(cm, path)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        pipeline.load(cm, path, optimizer=torch.optim.SGD(cm.parameters(), lr=0.1))


def test_tied_weights_save_and_load(tmp_path):
    model = Llama(LlamaConfig())
    model.head.weight = model.embed.weight  # tied: two state-dict keys, one storage
    cm = pipeline.jit(model, executors=["torch"])
    path = str(tmp_path / "t.safetensors")
    pipeline.save(cm, path)
    other = Llama(LlamaConfig())
    other.head.weight = other.embed.weight
    pipeline.load(pipeline.jit(other, executors=["torch"]), path)
    assert torch.equal(other.embed.weight, model.embed.weight) and other.head.weight is other.embed.weight


def test_zero_dim_state_saves_and_loads(tmp_path, convbn):
    """A 0-dim tensor in the state (BatchNorm's num_batches_tracked) loads whole: it has no rows to slice."""
    cm = pipeline.jit(convbn, executors=["torch"])
    cm(torch.randn(2, 3, 8, 8))
    path = str(tmp_path / "bn.safetensors")
    pipeline.save(cm, path)
    other = copy.deepcopy(convbn)
    for b in other.buffers():
        b.zero_()
    pipeline.load(pipeline.jit(other, executors=["torch"]), path)
    for (name, a), (_, b) in zip(convbn.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name
    assert other.state_dict()["bn.num_batches_tracked"].item() == 1


def test_optimizer_state_of_a_zero_dim_parameter_resumes(tmp_path):
    """AdamW keeps exp_avg of a 0-dim parameter as a 0-dim tensor: saved as a tensor, not a number."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.temperature = torch.nn.Linear(4, 2), torch.nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            return self.linear(x) / self.temperature

    def step(cm, opt, x):
        cm(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(3, 4)
    cm = pipeline.jit(model, executors=["torch"])
    opt = torch.optim.AdamW(cm.parameters(), lr=0.1)
    step(cm, opt, x)
    pipeline.save(cm, str(tmp_path / "s.safetensors"), optimizer=opt)
    resumed = copy.deepcopy(model)
    resumed_cm = pipeline.jit(resumed, executors=["torch"])
    resumed_opt = torch.optim.AdamW(resumed_cm.parameters(), lr=0.1)
    pipeline.load(resumed_cm, str(tmp_path / "s.safetensors"), optimizer=resumed_opt)
    step(cm, opt, x)
    step(resumed_cm, resumed_opt, x)
    assert torch.equal(resumed.temperature, model.temperature) and torch.equal(resumed.linear.weight, model.linear.weight)


def test_a_folder_missing_a_rank_file_is_refused_by_name(tmp_path):
    """A load that raced a save still being written (or a lost file) read the rows it found and broke on the rest."""
    from safetensors.torch import save_file
    save_file({"model.w": torch.zeros(2, 2)}, str(tmp_path / "rank0-of-2.safetensors"), metadata={"rows": "{}"})
    cm = pipeline.jit(torch.nn.Linear(2, 2), executors=["torch"])
    with pytest.raises(ValueError, match="holds 1 of the 2 rank files its save wrote"):
        pipeline.load(cm, str(tmp_path))
