"""Resharding: a checkpoint saved by one process loads into two fsdp ranks (model and optimizer
state), each rank reading only its rows; training then continues as the single process does.
(Two ranks into one process: test_fsdp.py.)"""
import os
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

import pipeline
from helpers import recording_safe_open
from models import Llama, LlamaConfig
from models.llama import next_token_loss
from test_fsdp import batches, free_port


def train(cm, opt, token_batches):
    for tokens in token_batches:
        next_token_loss(cm(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()


def rank_run(rank, world, port, out, path):
    from transforms import fsdp
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank + 10)
    cm = pipeline.jit(Llama(LlamaConfig(layers=1)), executors=["torch"], transforms=[fsdp()])
    opt = torch.optim.AdamW(cm.parameters(), lr=1e-2)
    requested = []
    with mock.patch("safetensors.safe_open", recording_safe_open(requested)):
        pipeline.load(cm, path, optimizer=opt)
    loaded = cm.state_dict()
    train(cm, opt, [t.chunk(world)[rank] for t in batches()[3:5]])
    continued = cm.state_dict()
    torch.save({"requested": [(k, (i.start, i.stop)) for k, i in requested], "loaded": loaded,
                "continued": continued}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_one_process_checkpoint_loads_into_two_ranks_reading_only_their_rows(tmp_path):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=1))
    cm = pipeline.jit(model, executors=["torch"])
    opt = torch.optim.AdamW(cm.parameters(), lr=1e-2)
    train(cm, opt, batches()[:3])
    path = str(tmp_path / "one.safetensors")
    pipeline.save(cm, path, optimizer=opt)
    train(cm, opt, batches()[3:5])
    mp.spawn(rank_run, args=(2, free_port(), str(tmp_path), path), nprocs=2)

    saved = load_file(path)
    for rank in range(2):
        r = torch.load(str(tmp_path / f"rank{rank}.pt"), weights_only=False)
        assert {k for k, _ in r["requested"]} == set(saved)  # every tensor, model and optimizer ...
        for key, (start, stop) in r["requested"]:            # ... as this rank's rows only
            n = saved[key].shape[0]
            rows = -(-n // 2)
            assert (start, stop) == (min(rank * rows, n), min((rank + 1) * rows, n)), key
        for key, value in r["loaded"].items():
            assert torch.equal(value, saved["model." + key]), key
        for key, value in model.state_dict().items():
            torch.testing.assert_close(r["continued"][key], value, rtol=1e-3, atol=1e-4, msg=key)
