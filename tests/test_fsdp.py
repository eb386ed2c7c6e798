"""fsdp over torch.distributed (2 processes, gloo): training matches single-process eager."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pipeline
from models import Llama, LlamaConfig
from models.llama import next_token_loss

STEPS, BATCH = 10, 4


def batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (BATCH, 16), generator=g) for _ in range(STEPS)]


def eager_run():
    torch.manual_seed(0)
    model = Llama(LlamaConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tokens in batches():
        loss = next_token_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def rank_run(rank, world, port, out):
    from transforms import fsdp
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Llama(LlamaConfig())
    full_param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cm = pipeline.jit(model, executors=["torch"], transforms=[fsdp()])
    opt = torch.optim.AdamW(cm.parameters(), lr=1e-2)
    losses = []
    for tokens in batches():
        part = tokens.chunk(world)[rank]
        loss = next_token_loss(cm(part), part)
        loss.backward()
        if not losses:
            grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in cm.parameters())
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    state = cm.state_dict()  # gathers the shards: every rank takes part
    checkpoint = os.path.join(out, "ckpt")
    pipeline.save(cm, checkpoint, optimizer=opt)  # each rank writes its part
    torch.manual_seed(rank + 10)
    resumed_model = Llama(LlamaConfig())
    resumed = pipeline.jit(resumed_model, executors=["torch"], transforms=[fsdp()])
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    pipeline.load(resumed, checkpoint, optimizer=resumed_opt)
    for tokens in batches()[:2]:
        part = tokens.chunk(world)[rank]
        for m, o in ((cm, opt), (resumed, resumed_opt)):
            next_token_loss(m(part), part).backward()
            o.step()
            o.zero_grad()
    resumes_identically = all(torch.equal(a, b) for a, b in zip(cm.parameters(), resumed.parameters()))
    continued = cm.state_dict()
    saved = [n for t in pipeline.last_traces(cm) if t.name == "g0_forward"
             for n, s in zip(t.output_values(), t.outputs) if s.kind == "saved"]
    keeps_full_param = any(
        n.op != "placeholder" and "wait_tensor" in str(n.target) for n in saved)
    torch.save({"losses": losses, "state": state if rank == 0 else None, "checkpoint": checkpoint,
                "continued": continued if rank == 0 else None,
                "param_bytes": sum(p.numel() * p.element_size() for p in cm.parameters()),
                "full_param_bytes": full_param_bytes, "grad_bytes": grad_bytes,
                "keeps_full_param": keeps_full_param, "resumes_identically": resumes_identically, "regions": [(r.stage, r.ops) for r in pipeline.regions(cm)]},
               os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fsdp"))
    mp.spawn(rank_run, args=(2, free_port(), out), nprocs=2)
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]


def test_fsdp_training_matches_single_process_eager(fsdp_results):
    losses, state = eager_run()
    assert set(fsdp_results[0]["state"]) == set(state)  # nothing dropped, nothing added
    for a, b in zip(fsdp_results[0]["losses"], losses):
        assert abs(a - b) <= 1e-5 * abs(b)
    # fp32 tolerance for 10 AdamW steps: the two ranks' gradient sums round differently from one
    # whole-batch sum, and Adam's m/sqrt(v) magnifies that for elements whose gradient is near zero.
    for key, value in state.items():
        torch.testing.assert_close(fsdp_results[0]["state"][key], value, rtol=1e-3, atol=1e-4, msg=key)


def test_each_rank_holds_half_the_parameters_and_gradients(fsdp_results):
    for r in fsdp_results:
        assert r["param_bytes"] <= r["full_param_bytes"] // 2 + 4096  # padding of odd first dims
        assert r["grad_bytes"] == r["param_bytes"]


def test_sharded_checkpoint_resumes_training_identically(fsdp_results):
    assert all(r["resumes_identically"] for r in fsdp_results)


def test_sharded_checkpoint_loads_into_an_eager_copy(fsdp_results, tmp_path_factory):
    path = fsdp_results[0]["checkpoint"]
    files = sorted(os.listdir(path))
    assert files == ["rank0-of-2.safetensors", "rank1-of-2.safetensors"]
    eager = Llama(LlamaConfig())
    eager.load_state_dict(pipeline.load_full(path))
    for key, value in eager.state_dict().items():
        assert torch.equal(value, fsdp_results[0]["state"][key]), key


def test_a_two_rank_checkpoint_resumes_training_in_one_process(fsdp_results):
    model = Llama(LlamaConfig())
    cm = pipeline.jit(model, executors=["torch"])
    opt = torch.optim.AdamW(cm.parameters(), lr=1e-2)
    pipeline.load(cm, fsdp_results[0]["checkpoint"], optimizer=opt)
    for key, value in model.state_dict().items():
        assert torch.equal(value, fsdp_results[0]["state"][key]), key
    for tokens in batches()[:2]:  # the steps the two ranks took after saving, on the whole batch
        next_token_loss(cm(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()
    for key, value in model.state_dict().items():  # Adam's moments came back too, or this would drift
        torch.testing.assert_close(value, fsdp_results[0]["continued"][key], rtol=1e-3, atol=1e-4, msg=key)


def test_no_full_parameter_is_kept_from_forward_to_backward(fsdp_results):
    assert not any(r["keeps_full_param"] for r in fsdp_results)
    backward_ops = {op for r in fsdp_results for stage, ops in r["regions"] if stage == "backward" for op in ops}
    assert any("all_gather" in op for op in backward_ops), "the backward gathers the parameters again"
    assert any("reduce_scatter" in op for op in backward_ops), "gradients are reduce-scattered"


def materialize_rank_run(rank, world, port, out, path):
    from unittest import mock

    from helpers import recording_safe_open
    from transforms import fsdp, materialize
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    requested = []
    with torch.device("meta"):
        model = Llama(LlamaConfig())
    with mock.patch("safetensors.safe_open", recording_safe_open(requested)):
        cm = pipeline.jit(model, executors=["torch"], transforms=[materialize(path), fsdp()])
    shards = {n.removesuffix(".shard"): p.detach().clone() for n, p in cm.named_parameters()}
    tokens = batches()[0]
    with torch.no_grad():
        logits = cm(tokens)
    torch.save({"requested": [(k, (s.start, s.stop)) for k, s in requested], "shards": shards,
                "logits": logits}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_materialize_and_fsdp_read_only_each_ranks_slices(tmp_path):
    from safetensors.torch import save_file
    torch.manual_seed(5)
    trained = Llama(LlamaConfig())
    path = str(tmp_path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, path)
    mp.spawn(materialize_rank_run, args=(2, free_port(), str(tmp_path), path), nprocs=2)
    full = trained.state_dict()
    with torch.no_grad():
        expected_logits = trained(batches()[0])
    for rank in range(2):
        r = torch.load(str(tmp_path / f"rank{rank}.pt"), weights_only=False)
        for name, shard in r["shards"].items():
            n = full[name].shape[0]
            rows = -(-n // 2)
            start, stop = rank * rows, min((rank + 1) * rows, n)
            assert torch.equal(shard[: stop - start], full[name][start:stop]), name
        ranges = dict(r["requested"])
        assert set(ranges) == set(r["shards"])  # every parameter came from the file ...
        for name, (start, stop) in ranges.items():  # ... as this rank's rows only
            n = full[name].shape[0]
            rows = -(-n // 2)
            assert (start, stop) == (min(rank * rows, n), min((rank + 1) * rows, n)), name
        torch.testing.assert_close(r["logits"], expected_logits)


def test_uneven_first_dims_are_padded_and_read_back_exactly():
    from transforms.fsdp import FSDP
    shards = []
    for rank in range(2):
        t = FSDP.__new__(FSDP)  # a rank's view without a process group: encode/rows are local
        t.world, t.rank = 2, rank
        value = torch.arange(15.0).view(5, 3)
        shard = t.encode(value)["shard"]
        assert shard.shape == (3, 3)
        start, stop = t.rows(value)
        assert torch.equal(shard[: stop - start], value[start:stop])
        assert torch.equal(t.encode_slices(value, value)["shard"], shard)  # a tensor slices like a file
        shards.append(shard)
    assert torch.equal(torch.cat(shards)[:5], torch.arange(15.0).view(5, 3))
    assert torch.equal(shards[1][2], torch.zeros(3))  # the padding row
