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



# A linear shaped as TE's fp8 one (`executors/te_executor.py`), on the CPU: an opaque forward returning
# y and its casts' scales; the backward casts x and W to fp8 again in plain torch ops
# (`_transposed_fp8`) and hands the bytes to an opaque backward op.
@torch.library.custom_op("test_fp8::linear", mutates_args=())
def _fp8_linear(x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    scales = [(t.abs().amax().float() / 448).reshape(1) for t in (x, w)]
    return [x @ w.t(), *scales]


@_fp8_linear.register_fake
def _(x, w):
    return [x.new_empty(x.shape[0], w.shape[0]), x.new_empty(1, dtype=torch.float32),
            x.new_empty(1, dtype=torch.float32)]


@torch.library.custom_op("test_fp8::linear_backward", mutates_args=())
def _fp8_linear_backward(dy: torch.Tensor, x_t: torch.Tensor, x_si: torch.Tensor, w_t: torch.Tensor,
                         w_si: torch.Tensor) -> list[torch.Tensor]:
    x, w = (t.t().view(torch.float8_e4m3fn).float() * si for t, si in ((x_t, x_si), (w_t, w_si)))
    return [(dy.float() @ w).to(dy.dtype), (dy.float().t() @ x).to(dy.dtype)]


@_fp8_linear_backward.register_fake
def _(dy, x_t, x_si, w_t, w_si):
    return [dy.new_empty(dy.shape[0], w_t.shape[0]), dy.new_empty(dy.shape[1], x_t.shape[0])]


def _fp8_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output[1:])


def _fp8_backward(ctx, grads):
    from executors.te_executor import _transposed_fp8
    x, w, x_si, w_si = ctx.saved_tensors
    return tuple(torch.ops.test_fp8.linear_backward(grads[0], _transposed_fp8(x, x_si), x_si,
                                                    _transposed_fp8(w, w_si), w_si))


_fp8_linear.register_autograd(_fp8_backward, setup_context=_fp8_setup)


def test_fp8_casts_are_made_in_the_backward_not_saved():
    """A weight's fp8 cast is half the bytes of the weight, which the backward has for free (a
    parameter): unless tagged (`recompute_fp8_casts`) the partitioner kept the cast from the forward.
    Nothing fp8 is saved, nor the normalized x (recomputed from the input), and the step matches eager."""
    torch.manual_seed(0)
    norm, w = torch.nn.RMSNorm(32).bfloat16(), torch.nn.Parameter(torch.randn(48, 32, dtype=torch.bfloat16))

    def f(x):
        y = torch.ops.test_fp8.linear(norm(x), w)[0]
        return torch.nn.functional.silu(y).float().square().mean()

    x = torch.randn(64, 32, dtype=torch.bfloat16)
    cm = pipeline.jit(f, executors=["torch"])
    cm(x).backward()
    grads = [p.grad.clone() for p in (w, norm.weight)]
    w.grad = norm.weight.grad = None
    f(x).backward()
    torch.testing.assert_close(grads, [w.grad, norm.weight.grad])
    forward = [t for t in pipeline.last_traces(cm) if t.name.endswith("_forward")][0]
    computed = [o.meta["val"] for o in forward.output_node().args[0][1:] if o.op != "placeholder"]
    assert computed and not [t for t in computed if t.dtype in (torch.uint8, torch.float8_e4m3fn)
                             or tuple(t.shape) == (64, 32)], [(t.dtype, tuple(t.shape)) for t in computed]


def test_fp8_casts_and_their_byte_views_are_tagged_for_recomputation():
    """The rule on a joint graph: the fp8 cast, its byte view, transpose and contiguous copy are
    tagged; not the fp32 values before it, nor an fp8 value the forward returns."""
    from torch.utils.checkpoint import CheckpointPolicy

    from pipeline.save_policy import recompute_fp8_casts

    def f(x, scale_inv):
        bytes_t = (x.float() / scale_inv).to(torch.float8_e4m3fn).view(torch.uint8).t().contiguous()
        returned = x.to(torch.float8_e5m2)
        return bytes_t.sum(), returned

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.randn(4, 8, dtype=torch.bfloat16), torch.ones(1))
    count = recompute_fp8_casts(gm, num_fwd_outputs=2)
    tagged = {n.name for n in gm.graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE}
    assert count == len(tagged) and {"_to_copy_1", "view", "t", "clone"} <= tagged, gm.code
    assert not tagged & {"_to_copy", "div", "_to_copy_2", "sum_1"}, gm.code  # fp32 ones; the returned one


def test_a_contiguous_copy_an_fp8_cast_reads_is_made_again_not_kept():
    """In a Llama, o_proj reads the attention output made contiguous (a clone of SDPA's output, which
    the backward keeps for SDPA's own backward): with fp8 linears (the TE-shaped stand-in) that copy
    is made again in the backward, not kept beside SDPA's output (0.5 GiB on the H200's 0.85B)."""
    from models import LanguageModelLoss, Llama, LlamaConfig

    class Fp8Linear(torch.nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.weight = linear.weight

        def forward(self, x):
            return torch.ops.test_fp8.linear(x.reshape(-1, x.shape[-1]), self.weight)[0].view(*x.shape[:-1], -1)
    config = LlamaConfig(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, hidden=176, max_seq=32)
    torch.manual_seed(0)
    model = LanguageModelLoss(Llama(config)).bfloat16()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and child.bias is None and name != "output":
                setattr(module, name, Fp8Linear(child))
    cm = pipeline.jit(model, executors=["torch"])
    cm(torch.randint(0, 256, (2, 32))).backward()
    forward = [t for t in pipeline.last_traces(cm) if t.name.endswith("_forward")][0]
    kept = [o for o in forward.output_node().args[0][1:] if o.op == "call_function"]
    copies = [o.name for o in kept if o.target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
              and tuple(o.meta["val"].shape) == (64, 64)]
    assert not copies, copies
    assert sum(tuple(o.meta["val"].shape) == (2, 4, 32, 16) for o in kept if "getitem" in o.name) == 2  # SDPA's outputs
