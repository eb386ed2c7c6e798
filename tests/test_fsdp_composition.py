"""fsdp + mixed_precision + checkpoint together (2 processes, gloo): training follows the same
passes in one process on the whole batch, within bf16 tolerance."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pipeline
from models import Llama, LlamaConfig
from models.llama import next_token_loss
from test_fsdp import batches, free_port
from transforms import checkpoint, mixed_precision

STEPS = 5


def passes():
    return [mixed_precision("bf16"), checkpoint("selective")]


def run(cm, rank=0, world=1):
    torch.manual_seed(0)
    opt = torch.optim.SGD(cm.parameters(), lr=0.5)
    losses = []
    for tokens in batches()[:STEPS]:
        part = tokens.chunk(world)[rank]
        loss = next_token_loss(cm(part).float(), part)  # bf16 logits, fp32 loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if world > 1:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses


def rank_run(rank, world, port, out):
    from transforms import fsdp
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    cm = pipeline.jit(Llama(LlamaConfig(layers=1)), executors=["torch"], transforms=[fsdp(), *passes()])
    losses = run(cm, rank, world)
    state = cm.state_dict()
    steps = {t.name: [s.name for s in t.provenance] for t in pipeline.last_traces(cm)}
    torch.save({"losses": losses, "state": state, "steps": steps}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_fsdp_mixed_precision_and_checkpoint_train_like_one_process(tmp_path):
    mp.spawn(rank_run, args=(2, free_port(), str(tmp_path)), nprocs=2)
    r = torch.load(str(tmp_path / "rank0.pt"), weights_only=False)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=1))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    losses = run(pipeline.jit(model, executors=["torch"], transforms=passes()))
    assert losses[-1] < losses[0]
    for a, b in zip(r["losses"], losses):
        assert abs(a - b) <= 1e-3 * abs(b), (r["losses"], losses)
    for key, value in model.state_dict().items():  # the updates agree to bf16 precision
        update, expected = r["state"][key] - initial[key], value - initial[key]
        if expected.norm() > 0:
            assert ((update - expected).norm() / expected.norm()).item() < 2e-2, key
    assert "mixed_precision(bf16)" in r["steps"]["g0_forward"]
    assert r["steps"]["g0_joint"][-2:] == ["checkpoint(selective)", "fsdp.regather_in_backward"]
