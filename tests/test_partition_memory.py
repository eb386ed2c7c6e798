"""What the forward saves for the backward: with Inductor listed, the loss keeps the bf16 logits and
two small reductions, not the fp32 log-probabilities (as torch.compile does); with only `torch`, ops
stay whole, so the torch executor still runs eager's own kernels."""
import copy

import torch

import pipeline
from executors.base import Executor
from executors.inductor_executor import inductor_executor
from helpers import assert_step_matches_eager
from models import LanguageModelLoss, Llama, LlamaConfig

VOCAB = 4000


class LikeInductor(Executor):
    """Claims everything, runs regions as they are, and asks for Inductor's decompositions before
    the partition: the partition is Inductor's, with no Inductor compile (fast on the CPU)."""
    name, kind = "like_inductor", "fusion"

    def claims_op(self, op, node):
        return True

    def compile_region(self, gm, example_inputs):
        return gm.forward

    def decompositions_before_partition(self):
        return inductor_executor.decompositions_before_partition()


def _saved_for_backward(cm):
    forward = [t for t in pipeline.last_traces(cm) if t.name.endswith("_forward")][0]  # as lowered
    outputs = forward.output_node().args[0]
    return [o.meta["val"] for o in outputs[1:] if isinstance(o.meta.get("val"), torch.Tensor)]


def _jitted(executors):
    torch.manual_seed(0)
    model = LanguageModelLoss(Llama(LlamaConfig(layers=1, vocab=VOCAB, max_seq=256)), fp32_loss=True)
    model = model.to(torch.bfloat16)
    return model, torch.randint(0, VOCAB, (2, 256)), pipeline.jit(model, executors=executors)


def _is_logits_sized(t):
    return t.dim() >= 2 and t.shape[-1] == VOCAB


def test_with_inductor_the_loss_saves_bf16_logits_not_fp32_log_probabilities():
    model, tokens, cm = _jitted([LikeInductor()])
    assert_step_matches_eager(model, cm, tokens, rtol=2e-2, atol=1e-3)
    saved = _saved_for_backward(cm)
    assert not [t for t in saved if _is_logits_sized(t) and t.dtype == torch.float32]
    assert [t for t in saved if _is_logits_sized(t) and t.dtype == torch.bfloat16]   # the logits


def test_with_only_torch_log_softmax_stays_whole():
    _, tokens, cm = _jitted(["torch"])
    cm(tokens).backward()
    forward = [t for t in pipeline.last_traces(cm) if t.name.endswith("_forward")][0]  # as lowered
    assert any(n.target is torch.ops.aten._log_softmax.default for n in forward.module.graph.nodes)
    assert [t for t in _saved_for_backward(cm) if _is_logits_sized(t) and t.dtype == torch.float32]


def test_inductor_computes_the_nll_gradient_inline_not_in_a_logits_sized_buffer():
    """NLL's backward decomposes to zeros + scatter: a logits-sized fp32 buffer (0.98 GiB for a 32k
    vocabulary at 8k tokens) unless Inductor's graph rewrites turn it into an inline one-hot, as
    inside torch.compile. The Inductor executor runs them on each region it compiles."""
    from executors.inductor_executor import _inductor_decomposed
    _, tokens, cm = _jitted([LikeInductor()])
    cm(tokens).backward()
    backward = [t for t in pipeline.last_traces(cm) if t.name.endswith("_backward")][-1]  # as executed
    region = next(m for m in backward.module.children() if hasattr(m, "source")).source
    before = [n for n in region.graph.nodes if n.target is torch.ops.aten.nll_loss_backward.default
              or "scatter" in str(n.target)]
    inputs = [n.meta["val"] for n in region.graph.nodes if n.op == "placeholder"]
    after = _inductor_decomposed(region, inputs)
    assert before, "the backward region should compute the NLL gradient"
    scatters = (torch.ops.aten.scatter.value, torch.ops.aten.scatter.src)
    assert not [n for n in after.graph.nodes if n.target in scatters], after.code


def test_a_linear_returning_a_list_still_leaves_the_loss_saving_bf16_logits(te_on_cpu):
    """TE's linear is a custom op returning a list: one `getitem` more between the logits and the
    backward, and by the partitioner's distance weighting the fp32 log-probabilities were saved
    (0.98 GiB at 8k tokens). No fp32 copy of a half-precision value is saved (`save_policy.py`)."""
    model, tokens, cm = _jitted([te_on_cpu, LikeInductor()])
    assert_step_matches_eager(model, cm, tokens, rtol=2e-2, atol=1e-3)
    saved = _saved_for_backward(cm)
    assert not [t for t in saved if _is_logits_sized(t) and t.dtype == torch.float32]
    assert [t for t in saved if _is_logits_sized(t) and t.dtype == torch.bfloat16]


def test_upcast_values_are_recomputed_unless_already_tagged():
    """The rule on a joint graph: the upcast and the full-size fp32 values computed from it alone
    (scalars and smaller broadcast tensors beside it) are tagged for recomputation; not a value
    that also reads another full-size tensor (a random one here), a reduction, a value tagged
    before, or a value the forward returns."""
    from torch.utils.checkpoint import CheckpointPolicy

    from pipeline.save_policy import recompute_upcasts

    def f(x):
        y = x.float()
        z = (y * 2).exp()
        shifted = y - y.amax(-1, keepdim=True)
        noisy = y + torch.rand_like(y)
        return z.sum(-1), noisy.sum(-1), shifted.exp()

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.randn(4, 8, dtype=torch.bfloat16))
    nodes = {n.name: n for n in gm.graph.nodes}
    nodes["exp"].meta["recompute"] = CheckpointPolicy.MUST_SAVE
    assert recompute_upcasts(gm, num_fwd_outputs=3) == 3
    tagged = {name for name, n in nodes.items() if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE}
    assert tagged == {"_to_copy", "mul", "sub"}, gm.code   # not amax, add (+ rand), exp_1 (returned)
    assert nodes["exp"].meta["recompute"] == CheckpointPolicy.MUST_SAVE  # tagged before: kept

    # a graph with torch.utils.checkpoint regions keeps the user's choices
    user = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.randn(4, 8, dtype=torch.bfloat16))
    next(iter(user.graph.nodes)).meta["ac_graph_id"] = 0
    assert recompute_upcasts(user, num_fwd_outputs=3) == 0


def test_a_buffer_updated_from_an_upcast_value_trains_like_eager():
    """The forward's outputs (here a buffer's new value) are never tagged: the backward would
    rebuild it from the buffer the forward already overwrote (autograd raised, found in review)."""
    class EMA(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter((torch.randn(64, 64) * 0.05).bfloat16())
            self.register_buffer("ema", torch.zeros(32, 64))

        def forward(self, x):
            y = (x @ self.w).float()
            self.ema.mul_(0.9).add_((y.tanh() * 0.1).detach())
            return (y.tanh() * self.ema).sum()

    torch.manual_seed(0)
    model = EMA()
    eager = copy.deepcopy(model)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    pipeline.jit(model, executors=["torch"])(x).backward()
    eager(x).backward()
    torch.testing.assert_close(model.w.grad, eager.w.grad, rtol=0, atol=0)
    torch.testing.assert_close(model.ema, eager.ema, rtol=0, atol=0)
