"""Chained model transforms: quantize("int8") then fsdp on the same weights (2 processes, gloo)
against single-process quantize; and chains that cannot compose."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pipeline
from models import Llama, LlamaConfig
from test_fsdp import free_port
from transforms import chain, quantize
from transforms.fsdp import FSDP


def tokens():
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))


def rank_run(rank, world, port, out):
    from transforms import fsdp
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    cm = pipeline.jit(Llama(LlamaConfig()).eval(), executors=["torch"], transforms=[quantize("int8"), fsdp()])
    held = {n: (p.dtype, tuple(p.shape)) for n, p in cm.named_parameters()}
    with torch.no_grad():
        logits = cm(tokens())
    before = {n: p.detach().clone() for n, p in cm.named_parameters()}
    state = cm.state_dict()  # gathers, then dequantizes
    cm.load_state_dict(state)
    round_trip = all(torch.equal(p, before[n]) for n, p in cm.named_parameters())
    path = os.path.join(out, "ckpt")
    pipeline.save(cm, path)
    torch.manual_seed(rank + 7)
    other = pipeline.jit(Llama(LlamaConfig()).eval(), executors=["torch"], transforms=[quantize("int8"), fsdp()])
    pipeline.load(other, path)
    loads_back = all(torch.equal(p, before[n]) for n, p in other.named_parameters())
    torch.save({"held": held, "logits": logits, "state": state, "round_trip": round_trip,
                "loads_back": loads_back, "path": path}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def chained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("chain"))
    mp.spawn(rank_run, args=(2, free_port(), out), nprocs=2)
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def single():
    torch.manual_seed(0)
    cm = pipeline.jit(Llama(LlamaConfig()).eval(), executors=["torch"], transforms=[quantize("int8")])
    with torch.no_grad():
        logits = cm(tokens())
    return cm, logits


def test_each_rank_holds_half_of_each_int8_weight_and_its_scales(chained, single):
    cm, _ = single
    whole = dict(cm.named_parameters())
    for r in chained:
        assert r["held"]["layers.0.attn.wq.weight.q.shard"] == (torch.int8, (32, 64))
        assert r["held"]["layers.0.attn.wq.weight.scale.shard"] == (torch.float32, (32, 1))
        assert r["held"]["embed.weight.shard"] == (torch.float32, (128, 64))  # only fsdp applies here
        assert {n.rsplit(".shard", 1)[0] for n in r["held"]} == set(whole)
        for name, (dtype, shape) in r["held"].items():
            full = whole[name.removesuffix(".shard")]
            assert dtype == full.dtype and shape == (-(-full.shape[0] // 2), *full.shape[1:]), name


def test_two_rank_inference_matches_single_process_quantize(chained, single):
    _, logits = single
    for r in chained:
        torch.testing.assert_close(r["logits"], logits, rtol=1e-5, atol=1e-5)


def test_state_dict_equals_single_process_quantize_key_for_key(chained, single):
    cm, _ = single
    expected = cm.state_dict()
    state = chained[0]["state"]
    assert set(state) == set(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key  # int8 dequantized values and scales identical


def test_state_dict_and_checkpoint_round_trip_bit_identically(chained, single):
    cm, _ = single
    assert all(r["round_trip"] and r["loads_back"] for r in chained)
    full = pipeline.load_full(chained[0]["path"])  # each rank's rows of weights and scales, put together
    expected = cm.state_dict()
    assert set(full) == set(expected)
    for key, value in expected.items():
        assert torch.equal(full[key], value), key


def fake_fsdp(world=2, rank=0):
    """An fsdp transform's local view without a process group: enough to build and check chains."""
    t = FSDP.__new__(FSDP)
    t.world, t.rank, t.name = world, rank, f"fsdp({world} ranks)"
    return t


def test_a_chain_that_cannot_compose_names_the_parameter_both_transforms_and_why():
    model = Llama(LlamaConfig())
    with pytest.raises(ValueError, match=r"layers.0.attn.wq.weight: quantize\(int8\) cannot follow "
                                         r"fsdp\(2 ranks\).*keep its own state \(scale\)"):
        pipeline.jit(model, executors=["torch"], transforms=[fake_fsdp(), quantize("int8")])


def test_fsdp_on_a_frozen_model_says_it_found_nothing_to_shard_and_why():
    """It used to be skipped silently: a frozen model trains nothing, so fsdp shards nothing."""
    model = Llama(LlamaConfig()).eval().requires_grad_(False)
    with pytest.raises(ValueError, match=r"fsdp\(2 ranks\) applies to no parameter of Llama \(it changes "
                                         r"floating-point parameters of one dim or more that require grad\)"):
        pipeline.jit(model, executors=["torch"], transforms=[quantize("int8"), fake_fsdp()])


def test_a_chain_object_is_the_list_and_applies_part_by_part():
    from transforms.chain import Chain, for_parameter
    model = Llama(LlamaConfig())
    q, f = quantize("int8"), fake_fsdp()
    linear = for_parameter([chain(q, f)], model.head, "head.weight", model.head.weight)
    assert isinstance(linear, Chain) and (linear.first, linear.then) == (q, f)
    assert for_parameter([chain(q, f)], model.embed, "embed.weight", model.embed.weight) is f
    assert for_parameter([q, f], model.head, "head.weight", model.head.weight).name == linear.name


def test_a_chain_encodes_and_decodes_through_both_transforms():
    weight = torch.randn(5, 3)
    for rank in range(2):
        c = chain(quantize("int8"), fake_fsdp(rank=rank))
        tensors = c.encode(weight)
        assert set(tensors) == {"q.shard", "scale.shard"} and tensors["q.shard"].shape == (3, 3)
        start, stop = c.row_shard(weight)
        rows = c.local_rows(tensors, weight)
        whole = quantize("int8").encode(weight)
        assert torch.equal(rows[""], quantize("int8").decode(whole)[start:stop])
        assert torch.equal(rows["scale"], whole["scale"][start:stop])
        for suffix, value in c.from_rows(rows, weight).items():
            assert torch.equal(value, tensors[suffix]), suffix
        for suffix, value in c.encode_slices(weight, weight).items():  # a tensor slices like a file
            assert torch.equal(value, tensors[suffix]), suffix
