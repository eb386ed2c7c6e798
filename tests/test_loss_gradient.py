"""The cross-entropy's backward as pointwise ops where nvFuser is listed (`executors/loss_gradient.py`): the same
gradients as eager for each reduction and ignored targets, no [tokens, vocab] fp32 buffer saved or made by NLL's
backward, the cast back to bf16 before the shift's pad; where only `torch` is listed, eager's own ops."""
import pytest
import torch
import torch.nn.functional as F

import pipeline
from helpers import assert_step_matches_eager, require_executors, values_passed_between_regions
from models import LanguageModelLoss, Llama, LlamaConfig

aten = torch.ops.aten
VOCAB = 512


def _ops(trace):
    return [n.target for n in trace.module.graph.nodes if n.op == "call_function"]


def _stage(cm, suffix):
    return [t for t in pipeline.last_traces(cm) if t.name.endswith(suffix)][0]  # as lowered


class Loss(torch.nn.Module):
    def __init__(self, reduction):
        super().__init__()
        self.head = torch.nn.Linear(16, VOCAB)
        self.reduction = reduction

    def forward(self, x, target):
        loss = F.cross_entropy(self.head(x).float(), target, reduction=self.reduction)
        return loss.sum() if self.reduction == "none" else loss


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_each_reduction_with_ignored_targets_gives_eagers_gradients(nvfuser_claims_on_cpu, reduction):
    torch.manual_seed(0)
    model = Loss(reduction)
    x, target = torch.randn(24, 16), torch.randint(0, VOCAB, (24,))
    target[::5] = -100  # ignored
    cm = pipeline.jit(model, executors=[nvfuser_claims_on_cpu])
    assert_step_matches_eager(model, cm, x, target, rtol=1e-5, atol=1e-6)
    backward = _ops(_stage(cm, "_backward"))
    assert aten.nll_loss_backward.default not in backward and aten._log_softmax_backward_data.default not in backward
    assert aten.exp.default in backward and aten.eq.Tensor in backward  # the pointwise form
    gradient = [r for r in pipeline.regions(cm) if r.stage == "backward" and "eq" in r.ops]
    assert gradient and all(r.executor == "nvfuser" and "exp" in r.ops for r in gradient), str(pipeline.regions(cm))
    forward = [r for r in pipeline.regions(cm) if r.stage == "forward"]
    assert aten.nll_loss_forward.default not in _ops(_stage(cm, "_forward"))  # a row sum of the one-hot entries
    assert [r.executor for r in forward if "exp" in r.ops] == ["nvfuser"], str(pipeline.regions(cm))
    rows = [v for v in values_passed_between_regions(cm, "forward") if tuple(v.shape) == (24, VOCAB)]
    assert len(rows) == 1, rows  # the logits (torch's addmm) reach nvFuser; no log-probabilities leave it


def test_every_target_ignored_gives_zero_gradients_as_in_eager(nvfuser_claims_on_cpu):
    torch.manual_seed(0)
    model = Loss("mean")
    x, target = torch.randn(8, 16), torch.full((8,), -100)
    cm = pipeline.jit(model, executors=[nvfuser_claims_on_cpu])
    loss = cm(x, target)
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(model(x, target))  # 0 / 0, as eager
    assert torch.count_nonzero(model.head.weight.grad) == 0


def test_a_target_out_of_range_makes_the_loss_nan_where_eager_raises(nvfuser_claims_on_cpu):
    """NLL's forward as a row sum cannot raise on a target out of range without waiting for the GPU; the loss it
    gives is NaN, never a plausible number (a row sum alone would pick nothing: 0)."""
    torch.manual_seed(0)
    model = Loss("mean")
    x, target = torch.randn(8, 16), torch.randint(0, VOCAB, (8,))
    target[3] = VOCAB + 7
    with pytest.raises((IndexError, RuntimeError)):
        model(x, target)
    cm = pipeline.jit(model, executors=[nvfuser_claims_on_cpu])
    assert torch.isnan(cm(x, target))
    assert aten.nll_loss_forward.default not in _ops(_stage(cm, "_forward"))


def test_llama_loss_saves_bf16_logits_and_pads_in_bf16(nvfuser_claims_on_cpu):
    """The shift left as a slice (`shift_labels` off): its backward pads the gradient cast to bf16 first."""
    torch.manual_seed(0)
    model = LanguageModelLoss(Llama(LlamaConfig(layers=1, vocab=VOCAB, max_seq=64)), fp32_loss=True).to(torch.bfloat16)
    tokens = torch.randint(0, VOCAB, (2, 32))
    cm = pipeline.jit(model, executors=[nvfuser_claims_on_cpu], transforms=[pipeline.without("shift_labels")])
    assert_step_matches_eager(model, cm, tokens, rtol=2e-2, atol=1e-3)
    forward = _stage(cm, "_forward")
    saved = [o.meta["val"] for o in forward.output_node().args[0][1:] if isinstance(o.meta.get("val"), torch.Tensor)]
    logits_sized = [t for t in saved if t.dim() >= 2 and t.shape[-1] == VOCAB]
    assert logits_sized and all(t.dtype == torch.bfloat16 for t in logits_sized)
    pads = [n for n in _stage(cm, "_backward").module.graph.nodes if n.target is aten.slice_backward.default]
    assert pads and all(n.meta["val"].dtype == torch.bfloat16 for n in pads)
    assert not [f for f in pipeline.compile_stats(cm).fallbacks if "pointwise_loss_gradient" in str(f)]


class LastToken(torch.nn.Module):
    """Classification from the last position: its loss reads a small slice of the upcast logits."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, h, target):
        return F.cross_entropy(self.head(h).float()[:, -1], target)


def test_a_small_slice_of_the_upcast_logits_is_saved_not_all_the_bf16_logits(nvfuser_claims_on_cpu):
    torch.manual_seed(0)
    model = LastToken().bfloat16()
    h, target = torch.randn(4, 64, 16, dtype=torch.bfloat16), torch.randint(0, VOCAB, (4,))
    cm = pipeline.jit(model, executors=[nvfuser_claims_on_cpu])
    assert_step_matches_eager(model, cm, h, target, rtol=2e-2, atol=1e-3)
    forward = _stage(cm, "_forward")
    saved = [o.meta["val"] for o in forward.output_node().args[0][1:] if isinstance(o.meta.get("val"), torch.Tensor)]
    logits_sized = [t for t in saved if t.dim() >= 2 and t.shape[-1] == VOCAB]
    assert logits_sized and all(t.numel() <= 4 * VOCAB for t in logits_sized), [(t.dtype, t.shape) for t in saved]


def test_with_only_torch_the_backward_keeps_eagers_ops():
    torch.manual_seed(0)
    model = Loss("mean")
    cm = pipeline.jit(model, executors=["torch"])
    cm(torch.randn(8, 16), torch.randint(0, VOCAB, (8,))).backward()
    assert aten.nll_loss_backward.default in _ops(_stage(cm, "_backward"))


@pytest.mark.cuda
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_on_cuda_nvfuser_runs_the_pointwise_gradient_like_eager(reduction):
    require_executors("nvfuser")
    torch.manual_seed(0)
    model = Loss(reduction).cuda().bfloat16()
    x, target = torch.randn(64, 16, device="cuda", dtype=torch.bfloat16), torch.randint(0, VOCAB, (64,), device="cuda")
    target[::7] = -100
    cm = pipeline.jit(model, executors=["nvfuser"], fallback="raise")
    assert_step_matches_eager(model, cm, x, target, rtol=2e-2, atol=2e-2)
    table = pipeline.regions(cm)
    for stage in ("forward", "backward"):  # the forward's NLL a row sum, the backward's gradient pointwise
        loss = [r for r in table if r.stage == stage and "eq" in r.ops]
        assert loss and all(r.executor == "nvfuser" and "exp" in r.ops for r in loss), str(table)
