"""nvFuser's claims: its translation table as a ClaimTable, for tensors on its device in dtypes it takes.

Runs on the CPU: the nodes carry fake CUDA tensors (FakeTensorMode makes them without a GPU)."""
import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from executors.nvfuser_executor import NvFuserExecutor, nvfuser_executor
from executors.nvfuser_ops import CLAIMS, OPS

aten = torch.ops.aten


def _node(target, *values, out, **kwargs) -> fx.Node:
    """A call_function node on placeholders carrying `values` as their `meta["val"]`, `out` as its own."""
    graph = fx.Graph()
    args = []
    for v in values:
        args.append(graph.placeholder(f"a{len(args)}"))
        args[-1].meta["val"] = v
    node = graph.call_function(target, tuple(args), kwargs)
    node.meta["val"] = out
    return node


@pytest.fixture
def fake():
    """`fake(device, dtype=bf16)`: a fake [4, 8] tensor on `device`, no GPU needed for "cuda"."""
    mode = FakeTensorMode()

    def make(device: str, dtype=torch.bfloat16):
        with mode:
            return torch.empty(4, 8, dtype=dtype, device=device)
    return make


def test_nvfuser_claims_table_holds_every_op_it_translates():
    assert NvFuserExecutor.claims_table is CLAIMS
    assert set(CLAIMS) == set(OPS) and len(CLAIMS) > 80


def test_nvfuser_claims_mul_on_cuda_tensors(fake):
    x = fake("cuda")
    assert nvfuser_executor.claims(_node(aten.mul.Tensor, x, x, out=x))


def test_nvfuser_refuses_an_op_it_does_not_translate(fake):
    x = fake("cuda")
    assert not nvfuser_executor.claims(_node(aten.mm.default, x, x, out=x))


def test_nvfuser_refuses_a_node_its_op_checker_rejects(fake):
    grad, x = fake("cuda"), fake("cuda")
    exact = _node(aten.gelu_backward.default, grad, x, out=x)
    tanh = _node(aten.gelu_backward.default, grad, x, out=x, approximate="tanh")
    assert nvfuser_executor.claims(exact) and not nvfuser_executor.claims(tanh)


def test_nvfuser_refuses_cpu_tensors_unless_its_device_is_the_cpu(fake):
    cpu, cuda = fake("cpu"), fake("cuda")
    assert not nvfuser_executor.claims(_node(aten.mul.Tensor, cpu, cpu, out=cpu))
    assert not nvfuser_executor.claims(_node(aten.mul.Tensor, cuda, cpu, out=cuda))  # one CPU input is enough
    on_cpu = NvFuserExecutor()
    on_cpu.device = "cpu"  # as the CPU tests' stand-in (`nvfuser_claims_on_cpu`) sets it
    assert on_cpu.claims(_node(aten.mul.Tensor, cpu, cpu, out=cpu))
    assert not on_cpu.claims(_node(aten.mul.Tensor, cuda, cuda, out=cuda))


def test_nvfuser_refuses_dtypes_it_does_not_take(fake):
    x64 = fake("cuda", torch.float64)
    assert not nvfuser_executor.claims(_node(aten.mul.Tensor, x64, x64, out=x64))
    x, out64 = fake("cuda"), fake("cuda", torch.float64)
    assert not nvfuser_executor.claims(_node(aten._to_copy.default, x, out=out64, dtype=torch.float64))
