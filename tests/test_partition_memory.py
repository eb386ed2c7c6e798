"""What the forward saves for the backward: with Inductor listed, the loss keeps the bf16 logits and
two small reductions, not the fp32 log-probabilities (as torch.compile does); with only `torch`, ops
stay whole, so the torch executor still runs eager's own kernels."""
import torch

import pipeline
from executors.base import Executor
from executors.inductor_executor import inductor_executor
from models import Llama, LlamaConfig
from models.llama import next_token_loss

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


class WithFp32Loss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return next_token_loss(self.model(tokens).float(), tokens)


def _saved_for_backward(cm):
    forward = [t for t in pipeline.last_traces(cm) if t.name.endswith("_forward")][0]  # as lowered
    outputs = next(n for n in reversed(forward.module.graph.nodes) if n.op == "output").args[0]
    return [o.meta["val"] for o in outputs[1:] if isinstance(o.meta.get("val"), torch.Tensor)]


def _train_once(executors):
    torch.manual_seed(0)
    model = WithFp32Loss(Llama(LlamaConfig(layers=1, vocab=VOCAB, max_seq=256))).to(torch.bfloat16)
    tokens = torch.randint(0, VOCAB, (2, 256))
    cm = pipeline.jit(model, executors=executors)
    loss = cm(tokens)
    loss.backward()
    return model, tokens, cm, loss


def _is_logits_sized(t):
    return t.dim() == 2 and t.shape[-1] == VOCAB


def test_with_inductor_the_loss_saves_bf16_logits_not_fp32_log_probabilities():
    model, tokens, cm, loss = _train_once([LikeInductor()])
    saved = _saved_for_backward(cm)
    assert not [t for t in saved if _is_logits_sized(t) and t.dtype == torch.float32]
    assert [t for t in saved if _is_logits_sized(t) and t.dtype == torch.bfloat16]   # the logits
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    expected = model(tokens)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=2e-2, atol=1e-3, msg=n)


def test_with_only_torch_log_softmax_stays_whole():
    _, _, cm, _ = _train_once(["torch"])
    forward = [t for t in pipeline.last_traces(cm) if t.name.endswith("_forward")][0]  # as lowered
    assert any(n.target is torch.ops.aten._log_softmax.default for n in forward.module.graph.nodes)
    assert [t for t in _saved_for_backward(cm) if _is_logits_sized(t) and t.dtype == torch.float32]
