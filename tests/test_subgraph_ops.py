"""Higher-order ops with bodies (cond's branches, nested_compile_region, flex_attention's score_mod): the body
goes into the region with its op, the result and gradients are eager's, cold and from the cache."""
import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

import pipeline


def branching(x):
    return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))


@torch.compiler.nested_compile_region
def _block(x):
    return x.sin() * 2


def block_twice(x):
    return _block(x) + _block(x * 3)


def relative_bias_attention(q):
    return flex_attention(q, q, q, score_mod=lambda score, b, h, i, j: score + (i - j))


POSITIVE = torch.linspace(0.1, 1, 5)
CASES = [(branching, POSITIVE, True), (branching, -POSITIVE, True), (block_twice, POSITIVE, True),
         (relative_bias_attention, torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(0)),
          False)]  # flex_attention has no backward on the CPU


def run_against_eager(fn, x, grad, executors):
    a, b = x.clone().requires_grad_(grad), x.clone().requires_grad_(grad)
    cm = pipeline.jit(fn, executors=executors, fallback="raise")
    out, ref = cm(a), fn(b)
    torch.testing.assert_close(out, ref)
    if grad:
        out.sum().backward()
        ref.sum().backward()
        torch.testing.assert_close(a.grad, b.grad)
    return cm


@pytest.mark.parametrize("fn, x, grad", CASES, ids=["cond true", "cond false", "nested_compile_region", "flex_attention"])
def test_higher_order_op_bodies_run_in_regions_cold_and_warm(fn, x, grad):
    for expected in ("miss", "hit"):
        torch._dynamo.reset()
        cm = run_against_eager(fn, x, grad, ["torch"])
        assert pipeline.compile_stats(cm).cache == {"g0": expected}
        assert {r.executor for r in pipeline.regions(cm)} == {"torch"}


def test_a_region_key_includes_its_ops_bodies():
    """Identical regions share one compiled code (`structure_key`): two conds differing only in a branch of a
    cond nested in theirs are not identical, and the same cond traced again is."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from executors.region_keys import structure_key

    def key(inner):
        def outer(y):
            return torch.cond(y.sum() > 1, lambda z: z.sin(), inner, (y,))
        return structure_key(make_fx(lambda x: torch.cond(x.sum() > 0, outer, lambda y: y.sin(), (x,)))(torch.ones(3)))
    assert key(lambda z: z.cos()) == key(lambda z: z.cos()) != key(lambda z: z.tan())


@pytest.mark.inductor
def test_inductor_leaves_nested_compile_region_to_torch():
    """Inductor (torch 2.13, CPU) gives wrong gradients for a nested_compile_region called twice, as under
    torch.compile: the op runs on `torch`, the rest on Inductor, and the gradients are eager's."""
    cm = run_against_eager(block_twice, POSITIVE, True, ["inductor"])
    owners = {r.executor for r in pipeline.regions(cm)}
    assert owners == {"inductor", "torch"}
    assert all("invoke_subgraph" in " ".join(r.ops) for r in pipeline.regions(cm) if r.executor == "torch")
