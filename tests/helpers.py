"""Differential-testing helpers: run a model in eager and through the pipeline on the same inputs."""
import copy
import weakref

import torch

from executors import Executor


def run_both(model, *inputs, executors=("torch",), train=False, **jit_kwargs):
    """Returns (eager output, jitted output, eager copy, jitted model). With `train`, also runs
    backward on out.sum() (after a fixed-weight projection, so every output element matters)."""
    import pipeline
    eager = copy.deepcopy(model)
    jitted = pipeline.jit(model, executors=list(executors), **jit_kwargs)
    outs = []
    for m in (eager, jitted):
        ins = [copy.deepcopy(i) for i in inputs]
        if train:
            out = m(*ins)
            _loss(out).backward()
        else:
            with torch.no_grad():
                out = m(*ins)
        outs.append(out)
    assert_compiled_by(jitted, executors)
    return outs[0], outs[1], eager, jitted


def require_executors(*names):
    """Skips the test where a listed executor cannot run (nvFuser or TE missing, no GPU), saying why."""
    import pytest

    import executors
    for n in names:
        availability = getattr(executors, n.split("-")[0]).available()
        if not availability:
            pytest.skip(availability.reason)


def assert_compiled_by(jitted, executors):
    """The jitted model compiled (no graph in eager, no fallback) and the first listed executor
    runs at least one region: matching eager alone would also pass with nothing compiled."""
    import pipeline
    stats = pipeline.compile_stats(jitted)
    assert stats.graphs > 0, "nothing was compiled"
    assert not stats.eager_fallbacks and not stats.fallbacks, f"fell back: {stats.fallbacks}"
    first = executors[0] if isinstance(executors[0], str) else executors[0].name
    owners = {r.executor for r in pipeline.regions(jitted)}
    assert first in owners, f"{first} runs no region; regions run on {sorted(owners)}"


def _loss(out):
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return (out * weights).sum()


def assert_same_grads(eager, jitted, exact=True, rtol=1.3e-6, atol=1e-5):
    for (name, p), (_, q) in zip(eager.named_parameters(), jitted.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is None:
            continue
        if exact:
            assert torch.equal(p.grad, q.grad), f"grad of {name} differs by {(p.grad - q.grad).abs().max()}"
        else:
            torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=atol, msg=f"grad of {name}")


def assert_step_matches_eager(model, jitted, *inputs, rtol, atol):
    """One forward + backward of `jitted` (which wraps `model`, sharing its parameters), then the
    same step of `model` in eager: the losses and every gradient match."""
    loss = jitted(*inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    expected = model(*inputs)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=rtol, atol=atol, msg=n)


def recording_safe_open(requested: list):
    """A stand-in for `safetensors.safe_open` that records every (key, index) read through
    `get_slice(key)[index]` and fails on whole-tensor reads (`get_tensor`)."""
    import safetensors
    real_open = safetensors.safe_open

    class Recorded:
        def __init__(self, key, inner):
            self.key, self.inner = key, inner

        def __getitem__(self, index):
            requested.append((self.key, index))
            return self.inner[index]

        def get_shape(self):
            return self.inner.get_shape()

    class SafeOpen:
        def __init__(self, *args, **kwargs):
            self.cm = real_open(*args, **kwargs)

        def __enter__(self):
            self.f = self.cm.__enter__()
            return self

        def __exit__(self, *exc):
            return self.cm.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def metadata(self):
            return self.f.metadata()

        def get_slice(self, key):
            return Recorded(key, self.f.get_slice(key))

        def get_tensor(self, key):
            raise AssertionError(f"{key} was read whole, not through slices")

    return SafeOpen


class Claiming(Executor):
    """A test executor claiming a fixed set of ops; it records the regions it is given."""

    def __init__(self, name, ops=(), kind="fusion", tag=None, fail=False):
        self.name, self.kind, self.ops, self.tag, self.fail = name, kind, set(ops), tag, fail
        self.received = []

    def claims_op(self, op, node):
        return op in self.ops or (self.tag is not None and isinstance(op, torch._ops.OpOverload)
                                  and self.tag in op.tags)

    def compile_region(self, gm, example_inputs):
        if self.fail:
            raise RuntimeError(f"{self.name} cannot compile this")
        self.received.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward


class FreesInputs(Executor):
    """A fusion executor whose regions have a boxed entry that frees the inputs it reads last; for
    each region call it appends to `freed` how many of the region's input tensors died inside it."""
    name, kind = "frees_inputs", "fusion"

    def __init__(self, freed: list, claim=lambda op: True):
        self.freed, self.claim = freed, claim

    def claims_op(self, op, node):
        return self.claim(op)

    def compile_region(self, gm, example_inputs):
        freed = self.freed

        class Run:
            def __call__(self, *args):
                return tuple(gm(*args))

            def boxed(self, args):
                refs = [weakref.ref(a) for a in args if isinstance(a, torch.Tensor)]
                out = tuple(gm(*args))
                args.clear()
                freed.append(sum(r() is None for r in refs))
                return out
        return Run()


def assert_llama_step_matches_eager(config, executors, batch=2):
    """One training step of a bf16 Llama with an fp32 loss through `pipeline.jit(executors)`, then
    the same step in eager on the same parameters: loss and every gradient match (bf16 tolerances).
    Returns the jitted model, for its region table."""
    import pipeline
    from models import LanguageModelLoss, Llama
    torch.manual_seed(0)
    model = LanguageModelLoss(Llama(config), fp32_loss=True).bfloat16()
    cm = pipeline.jit(model, executors=list(executors))
    tokens = torch.randint(0, config.vocab, (batch, config.max_seq))
    loss = cm(tokens)
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    model.zero_grad()
    expected = model(tokens)
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=1e-2, rtol=1e-2)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad.float(), atol=2e-2, rtol=5e-2, msg=n)
    assert_compiled_by(cm, list(executors))
    return cm


def values_passed_between_regions(cm, stage=None) -> list:
    """The tensors one region of a stage returns and a later region of the same stage reads (what a
    split island writes to memory; a stage's own inputs and outputs, saved activations included, are
    not counted); of the stage named `stage` alone if given."""
    import pipeline
    from ir import node_value
    passed = []
    for trace in pipeline.last_traces(cm):
        if stage is not None and trace.stage.value != stage:
            continue
        regions = {n for n in trace.module.graph.nodes if n.op == "call_module"}
        for node in trace.module.graph.nodes:
            if node.op == "call_function" and node.args and node.args[0] in regions:  # an element of a region's result
                if any(u in regions for u in node.users):
                    passed.append(node_value(node))
    return [v for v in passed if isinstance(v, torch.Tensor)]
