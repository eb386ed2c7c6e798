"""The cross-entropy as pointwise ops and row sums, for a fusion executor that takes the loss whole (`nvfuser`:
docs/executors.md). Autograd's NLL backward scatters into a zero [tokens, vocab] buffer whose rows log-softmax's
backward then sums; the sum is that one entry, so the gradient is `scale * (one_hot - exp(log_probs))` with no
buffer and no reduction, and its cast back to half precision moves before the shift's `slice_backward`. NLL's forward
(a gather) becomes a one-hot row sum: the fusion making the fp32 log-probabilities reduces them, never writing them."""

import torch

from ir import Trace
from ir.rewrite import Call, Match, derive_rewritten, rewrite
from ir.torch_ops import erase_unread

from .decompose import replace_by_traced

aten = torch.ops.aten
NLL_BACKWARD = Call(aten.nll_loss_backward.default,
                    ("grad_output", "self", "target", "weight", "reduction", "ignore_index", "total_weight"),
                    bind="nll", grad_output="grad", target="target", weight=lambda w: w is None,
                    reduction="reduction", ignore_index="ignore_index", total_weight="total_weight")
GRADIENT = Call(aten._log_softmax_backward_data.default, ("grad_output", "output", "dim", "input_dtype"),
                grad_output=NLL_BACKWARD, output="log_probs", dim=lambda d: d in (1, -1), input_dtype="dtype")
NLL_FORWARD = Call(aten.nll_loss_forward.default, ("input", "target", "weight", "reduction", "ignore_index"),
                  input="log_probs", target="target", weight=lambda w: w is None, reduction="reduction",
                  ignore_index="ignore_index")
CAST_OF_PADDED = Call(aten._to_copy.default, ("x", "dtype", "layout", "device", "pin_memory", "non_blocking",
                                              "memory_format"), x=Call(aten.slice_backward.default, (
    "grad_output", "input_sizes", "dim", "start", "end", "step"), bind="padded", grad_output="grad"))


def pointwise_loss_gradient(trace: Trace) -> Trace:
    """On the joint graph; `trace` itself when it has neither pattern."""
    gm = trace.editable()
    done = rewrite(gm.graph, [(GRADIENT, _pointwise, _plain_nll_on_rows), (CAST_OF_PADDED, _cast_first, _only_a_cast),
                              (NLL_FORWARD, _row_sum, _computed_rows)])
    if not done:
        return trace
    erase_unread([m["nll"] for m in done if "nll" in m])
    return derive_rewritten(trace, gm, "pointwise_loss_gradient")


def _plain_nll_on_rows(m: Match) -> bool:
    """NLL over [tokens, classes] with a known reduction, its gradient read by log-softmax's backward alone."""
    return len(m["nll"].users) == 1 and m.value("log_probs").dim() == 2 and m["reduction"] in (0, 1, 2)


def _pointwise(m: Match) -> None:
    replace_by_traced(m.root, _gradient, *(m[k] for k in ("grad", "log_probs", "target", "total_weight", "reduction",
                                                          "ignore_index", "dtype")))


def _gradient(grad, log_probs, target, total_weight, reduction, ignore_index, dtype):
    """NLL's backward then log-softmax's, for weight None: each row's one nonzero entry is `scale`."""
    scale = -grad / total_weight if reduction == 1 else -grad  # reduction 1: mean; 2: sum; 0: none, per row
    scale = torch.where(target != ignore_index, scale, torch.zeros_like(scale))
    one_hot = torch.arange(log_probs.shape[1], device=target.device) == target.unsqueeze(1)
    return (scale.unsqueeze(1) * (one_hot.to(log_probs.dtype) - log_probs.exp())).to(dtype)


def _computed_rows(m: Match) -> bool:
    """NLL over [tokens, classes] computed in the graph (a graph input's row sum would read it all, not one entry)."""
    return m.value("log_probs").dim() == 2 and m["log_probs"].op == "call_function" and m["reduction"] in (0, 1, 2)


def _row_sum(m: Match) -> None:
    replace_by_traced(m.root, _nll, *(m[k] for k in ("log_probs", "target", "reduction", "ignore_index")))


def _nll(log_probs, target, reduction, ignore_index):
    """NLL's forward for weight None, its total weight as ATen's: the count of kept targets (0 without reduction). A
    target out of range, which ATen's gather refuses, makes its loss NaN: a row sum would pick nothing (0), silently."""
    kept, classes = target != ignore_index, log_probs.shape[1]
    one_hot = torch.arange(classes, device=target.device) == target.unsqueeze(1)
    in_range = torch.logical_and(target >= 0, target < classes)
    picked = torch.where(in_range, torch.where(one_hot, log_probs, 0.0).sum(1), float("nan"))
    losses = torch.where(kept, -picked, 0.0)
    if reduction == 0:
        return losses, log_probs.new_zeros(())
    total_weight = kept.sum().to(log_probs.dtype)
    return (losses.sum() / total_weight if reduction == 1 else losses.sum()), total_weight


def _only_a_cast(m: Match) -> bool:
    """A cast of dtype only (no device, layout or memory format given) of the pad's one use."""
    kwargs, grad = m.root.kwargs, m.value("grad")
    return (not m.root.args[1:] and len(m["padded"].users) == 1 and kwargs.get("dtype") is not None
            and set(kwargs) <= {"dtype", "layout", "device"} and kwargs.get("layout", torch.strided) == torch.strided
            and kwargs.get("device", grad.device) == grad.device)


def _cast_first(m: Match) -> None:
    padded, dtype = m["padded"], m.root.kwargs["dtype"]
    replace_by_traced(m.root, lambda g, *args: aten.slice_backward(g.to(dtype), *args), m["grad"], *padded.args[1:])
    erase_unread([padded])
