"""The default pass `shift_labels`: a next-token loss that slices the logits shifts the labels instead; the same loss
and gradients as eager, no slice of the logits left in forward or backward, and the losses it must not touch left
alone."""
import pytest
import torch
import torch.nn.functional as F

import pipeline
from helpers import assert_compiled_by

V = 12


def rewritten(cm) -> bool:
    return any(step.name == "shift_labels" for t in pipeline.last_traces(cm) for step in t.provenance)


def logits_slices(cm) -> list[str]:
    """The slice ops (or their backward) over a tensor whose last dim is the vocabulary, in forward and backward."""
    return [str(n.target) for t in pipeline.last_traces(cm) if t.stage.value in ("forward", "backward")
            for n in t.module.graph.nodes if "slice" in str(n.target) and n.meta["val"].shape[-1] == V]


def check(loss_fn, logits, labels, *, applies=True, **jit):
    cm = pipeline.jit(loss_fn, executors=["torch"], **jit)
    x = logits.clone().requires_grad_()
    got = cm(x, labels)
    (grad,) = torch.autograd.grad(got.sum(), x)
    x = logits.clone().requires_grad_()
    expected = loss_fn(x, labels)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(grad, expected_grad)
    assert_compiled_by(cm, ["torch"])
    assert rewritten(cm) == applies, [t.provenance for t in pipeline.last_traces(cm)]
    return cm


def test_a_shifted_loss_reads_the_whole_logits_and_matches_eager():
    def loss_fn(logits, tokens):
        return F.cross_entropy(logits.float()[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1))

    cm = check(loss_fn, torch.randn(3, 7, V), torch.randint(0, V, (3, 7)))
    assert logits_slices(cm) == []
    without = check(loss_fn, torch.randn(3, 7, V), torch.randint(0, V, (3, 7)), applies=False,
                    transforms=[pipeline.without("shift_labels")])
    assert "aten.slice_backward.default" in logits_slices(without)  # what the pass removes


@pytest.mark.parametrize("kwargs", [dict(ignore_index=3), dict(reduction="sum"), dict(label_smoothing=0.1),
                                    dict(weight=torch.rand(V) + 0.5), dict(ignore_index=-1, reduction="sum")])
def test_hugging_faces_older_spelling_and_the_losss_options_match_eager(kwargs):
    """`[..., :-1, :].contiguous().view(-1, V)` (transformers before 4.46); labels holding `ignore_index` too."""
    def loss_fn(logits, labels):
        shift_logits, shift_labels = logits[..., :-1, :].contiguous(), labels[..., 1:].contiguous()
        return F.cross_entropy(shift_logits.view(-1, V), shift_labels.view(-1), **kwargs)

    labels = torch.randint(0, V, (2, 9))
    labels[0, 4] = labels[1, 2] = kwargs.get("ignore_index", -100)
    check(loss_fn, torch.randn(2, 9, V), labels)


@pytest.mark.parametrize("name, loss_fn", [
    ("per-token losses (reduction none)",
     lambda x, t: F.cross_entropy(x[:, :-1].reshape(-1, V), t[:, 1:].reshape(-1), reduction="none")),
    ("the first position dropped", lambda x, t: F.cross_entropy(x[:, 1:].reshape(-1, V), t[:, :-1].reshape(-1))),
    ("two positions dropped", lambda x, t: F.cross_entropy(x[:, :-2].reshape(-1, V), t[:, 2:].reshape(-1))),
    ("the vocabulary sliced", lambda x, t: F.cross_entropy(x[..., :-1].reshape(-1, V - 1), t.reshape(-1) % 11)),
    ("class probabilities as labels",
     lambda x, t: F.cross_entropy(x[:, :-1].reshape(-1, V), F.one_hot(t[:, 1:], V).float().reshape(-1, V))),
    ("the shifted logits read twice", lambda x, t: (lambda s: F.cross_entropy(s.reshape(-1, V), t[:, 1:].reshape(-1))
                                                    + s.mean())(x[:, :-1])),
    ("the shifted copy read twice", lambda x, t: (lambda s: F.cross_entropy(s.view(-1, V), t[:, 1:].reshape(-1))
                                                  + s.mean())(x[:, :-1].contiguous())),
])
def test_losses_the_pass_must_not_change_are_left_alone(name, loss_fn):
    check(loss_fn, torch.randn(2, 6, V), torch.randint(0, V, (2, 6)), applies=False)


def _written_after_the_copy(x, t):  # the loss would read the write through the whole logits
    logits = x * 1.0
    shifted = logits[..., :-1, :].contiguous()
    logits.div_(2.0)
    return F.cross_entropy(shifted.view(-1, V), t[:, 1:].reshape(-1)) + logits.logsumexp(-1).mean()


def _sliced_without_grad(x, t):  # a logged metric: the rewritten loss would send gradients into x
    with torch.no_grad():
        shifted = x[:, :-1]
    return F.cross_entropy(shifted.reshape(-1, V), t[:, 1:].reshape(-1)) + x.square().mean()


@pytest.mark.parametrize("loss_fn", [_written_after_the_copy, _sliced_without_grad])
def test_a_write_or_a_grad_mode_change_between_slice_and_loss_leaves_it_alone(loss_fn):
    check(loss_fn, torch.randn(2, 6, V), torch.randint(0, V, (2, 6)), applies=False)
