"""materialize: a model built on the meta device gets storage at jit time, from its init or a file."""
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

import pipeline
from helpers import recording_safe_open
from models import Llama, LlamaConfig
from transforms import materialize, quantize


def meta_llama():
    with torch.device("meta"):
        return Llama(LlamaConfig())


def test_meta_model_is_initialised_by_its_own_init_code():
    model = meta_llama()
    cm = pipeline.jit(model, executors=["torch"], transforms=[materialize()])
    assert all(p.device.type == "cpu" for p in cm.parameters())
    reference = Llama(LlamaConfig())
    assert torch.equal(model.layers[0].cos, reference.layers[0].cos)      # buffers recomputed
    assert torch.equal(model.norm.weight, torch.ones(64))                 # RMSNorm init
    assert model.head.weight.std() > 0                                    # nn.Linear init ran
    with torch.no_grad():
        assert torch.isfinite(cm(torch.randint(0, 256, (2, 16)))).all()


def test_meta_model_loads_a_checkpoint_tensor_by_tensor(tmp_path):
    trained = Llama(LlamaConfig()).eval()
    path = str(tmp_path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, path)
    requested = []
    model = meta_llama().eval()
    with mock.patch("safetensors.safe_open", recording_safe_open(requested)):
        cm = pipeline.jit(model, executors=["torch"], transforms=[materialize(path)])
    assert sorted(key for key, _ in requested) == sorted(trained.state_dict())
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(cm(tokens), trained(tokens))


def test_checkpoint_missing_a_tensor_is_an_error(tmp_path):
    trained = Llama(LlamaConfig())
    state = {k: v.contiguous() for k, v in trained.state_dict().items() if k != "head.weight"}
    path = str(tmp_path / "partial.safetensors")
    save_file(state, path)
    with pytest.raises(KeyError, match="head.weight"):
        pipeline.jit(meta_llama(), executors=["torch"], transforms=[materialize(path)])


def test_materialize_then_quantize_holds_int8_weights():
    model = meta_llama().eval()
    cm = pipeline.jit(model, executors=["torch"], transforms=[materialize(), quantize("int8")])
    assert {p.dtype for n, p in cm.named_parameters() if n.endswith(".q")} == {torch.int8}
    with torch.no_grad():
        assert torch.isfinite(cm(torch.randint(0, 256, (2, 16)))).all()
