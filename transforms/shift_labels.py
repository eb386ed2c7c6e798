"""`shift_labels()`: a next-token loss written `cross_entropy(logits[:, :-1].reshape(-1, V), labels)` shifts the labels
instead (`ignore_index` after each row's last label, as Hugging Face's loss does): the slice makes the reshape copy
the [tokens, vocab] logits, and its backward writes them again into a zero buffer (`slice_backward`); an executor that
cannot fuse the slice (nvFuser) passes them between regions. Why: docs/passes.md, "Built in: the default passes"."""

import operator

import torch
import torch.nn.functional as F

from ir import Trace, fake_like
from ir.rewrite import Call, Match, add_call, derive_rewritten, rewrite
from ir.torch_ops import changes_between, erase_unread

from .base import TracePass, pass_factory

SHIFTED = Call(("__getitem__", operator.getitem), ("input", "index"), "shifted", input="logits", index="index")
ROWS = Call(("reshape", "view"), ("input", "*shape"), "rows",
            input=Call(("contiguous", "float"), ("input",), "copy", input=SHIFTED) | SHIFTED)
NEXT_TOKEN_LOSS = Call(F.cross_entropy, ("input", "target", "weight", "size_average", "ignore_index", "reduce",
                                         "reduction", "label_smoothing"), input=ROWS, target="labels",
                       size_average=lambda v: v is None, reduce=lambda v: v is None,
                       reduction=lambda r: r in (None, "mean", "sum"), ignore_index="ignore_index")


@pass_factory
def shift_labels() -> TracePass:
    return TracePass(shift_labels_in, runs_on="before_autodiff", name="shift_labels")


def shift_labels_in(trace: Trace) -> Trace:
    """`trace` with each such loss reading the whole logits; `trace` itself if none."""
    gm = trace.editable()
    if not rewrite(gm.graph, [(NEXT_TOKEN_LOSS, _read_all_rows, _drops_each_rows_last)]):
        return trace
    return derive_rewritten(trace, gm, "shift_labels")


def _drops_each_rows_last(m: Match) -> bool:
    """[B, S, V] static logits less position S-1, as rows only the loss reads; labels: B*(S-1) class indices; nothing
    between the slice and the loss writes in place or changes grad mode (the loss would read the logits it wrote)."""
    logits, labels, rows = m.value("logits"), m.value("labels"), m.value("rows")
    if not (isinstance(logits, torch.Tensor) and logits.dim() == 3 and all(isinstance(n, int) for n in logits.shape)):
        return False
    b, s, v = logits.shape
    only_the_loss_reads = all(len(m[k].users) == 1 for k in ("shifted", "copy", "rows") if k in m)
    return (s > 1 and _drops_last_position(m["index"], s) and tuple(rows.shape) == (b * (s - 1), v)
            and isinstance(labels, torch.Tensor) and not labels.is_floating_point()  # probabilities: no ignore_index
            and tuple(labels.shape) == (b * (s - 1),) and only_the_loss_reads and not changes_between(m.nodes))


def _drops_last_position(index, s: int) -> bool:
    """Whether `index` (of a 3-D tensor) is `[:, :-1]`, `[:, :s-1, :]`, `[..., :-1, :]` or the like."""
    items = index if isinstance(index, tuple) else (index,)
    if items[:1] == (Ellipsis,):
        items = (slice(None),) * (4 - len(items)) + items[1:]
    items = items + (slice(None),) * (3 - len(items))
    if len(items) != 3 or not all(isinstance(i, slice) for i in items):
        return False
    whole, position = slice(None), items[1]
    return (items[0] == whole == items[2] and position.start in (None, 0) and position.stop in (-1, s - 1)
            and position.step in (None, 1))


def _read_all_rows(m: Match) -> None:
    loss, logits, labels, rows, graph = m.root, m["logits"], m["labels"], m["rows"], m.root.graph
    (b, s, v), labels_value = m.value("logits").shape, m.value("labels")
    ignore = -100 if m["ignore_index"] is None else m["ignore_index"]
    m["shifted"].replace_all_uses_with(logits)
    if "copy" in m:  # `.contiguous()` or `.float()`, now of the whole logits
        m["copy"].meta["val"] = m["copy"].meta["example_value"] = fake_like(m.value("copy"), (b, s, v))
    rows.args = (rows.args[0], -1, v)
    rows.meta["val"] = rows.meta["example_value"] = fake_like(m.value("rows"), (b * s, v))
    with graph.inserting_before(loss):
        grid = add_call(graph, "reshape", (labels, b, s - 1), fake_like(labels_value, (b, s - 1)))
        padded = add_call(graph, F.pad, (grid, (0, 1), "constant", ignore), fake_like(labels_value, (b, s)))
        flat = add_call(graph, "reshape", (padded, -1), fake_like(labels_value, (b * s,)))
    loss.replace_input_with(labels, flat)
    erase_unread([m["shifted"]])
