"""mixed_precision, checkpoint and cpu_offload: differential against eager, and what they change."""
import copy

import pytest
import torch
import torch.nn as nn

import pipeline
from ir import node_value
from models import Llama, LlamaConfig
from models.llama import SwiGLU, next_token_loss
from transforms import checkpoint, cpu_offload, mixed_precision


def llama_step(model, tokens):
    loss = next_token_loss(model(tokens), tokens)
    loss.backward()
    return loss


def trace_named(cm, name, made_by=None):
    return [t for t in pipeline.last_traces(cm) if t.name == name
            and (made_by is None or t.provenance[-1].name == made_by)][-1]


def saved_activation_bytes(cm):
    forward = trace_named(cm, "g0_forward", "dispatch: compile or load regions")
    return sum(node_value(v).numel() * node_value(v).element_size()
               for v, s in zip(forward.output_values(), forward.outputs)
               if s.kind == "saved" and v.op != "placeholder" and isinstance(node_value(v), torch.Tensor))


# -- mixed precision -------------------------------------------------------------------------------
def test_mixed_precision_matches_eager_autocast_bit_for_bit_on_swiglu():
    mlp = SwiGLU(LlamaConfig())
    eager = copy.deepcopy(mlp)
    cm = pipeline.jit(mlp, executors=["torch"], transforms=[mixed_precision("bf16")])
    x = torch.randn(2, 8, 64)
    out = cm(x)
    with torch.autocast("cpu", torch.bfloat16):
        ref = eager(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    out.float().sum().backward()
    ref.float().sum().backward()
    for (name, p), (_, q) in zip(mlp.named_parameters(), eager.named_parameters()):
        assert p.dtype == p.grad.dtype == torch.float32, "master weights and grads stay fp32"
        assert torch.equal(p.grad, q.grad), name


def test_mixed_precision_llama_matches_eager_autocast_within_bf16_tolerance():
    model = Llama(LlamaConfig())
    eager = copy.deepcopy(model)
    tokens = torch.randint(0, 256, (2, 16))
    cm = pipeline.jit(model, executors=["torch"], transforms=[mixed_precision("bf16")])
    loss = llama_step(cm, tokens)
    with torch.autocast("cpu", torch.bfloat16):
        logits = eager(tokens)
    ref = next_token_loss(logits, tokens)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=5e-2, atol=5e-3, msg=name)
    forward = str(trace_named(cm, "g0_forward", "lower (forward)"))
    assert "aten.mm.default" in forward and "# bf16[32, 64]" in forward      # matmuls in bf16
    assert "aten.mean.dim(pow_1, [-1], True)  # f32" in forward                 # the norm stays fp32
    assert "_enter_autocast" in str(trace_named(cm, "g0_captured", "mixed_precision(bf16)"))


class AutocastOffInside(nn.Module):
    """As Hugging Face's rotary embedding does under autocast: a region that turns autocast off, in fp32."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            h = self.fc(x.float()).sin()
        return self.out(h)


def test_an_autocast_region_in_forward_compiles_and_matches_eager():
    """Dynamo records its `_enter_autocast` (a context, no value): the verifier sent the whole graph to eager."""
    torch.manual_seed(0)
    model, x = AutocastOffInside(), torch.randn(4, 8)
    eager = copy.deepcopy(model)
    cm = pipeline.jit(model, executors=["torch"], fallback="raise")
    outs = []
    for run in (cm, eager):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(run(x))
        outs[-1].float().square().sum().backward()
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    torch.testing.assert_close(outs[0], outs[1])
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1.6e-2, atol=1e-2)  # bf16 matmuls in the backward


def test_mixed_precision_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="dtype must be one of"):
        mixed_precision("int4")


def test_fp16_trains_with_grad_scaler():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    cm = pipeline.jit(model, executors=["torch"], transforms=[mixed_precision("fp16")])
    opt = torch.optim.SGD(cm.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    losses = []
    for _ in range(5):
        loss = ((cm(x).float() - y) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in cm.parameters())


# -- checkpointing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["full", "selective", lambda node: "mm" in str(node.target)])
def test_checkpoint_keeps_results_and_saves_less(policy):
    model = Llama(LlamaConfig())
    baseline_model = copy.deepcopy(model)
    tokens = torch.randint(0, 256, (2, 16))
    baseline = pipeline.jit(baseline_model, executors=["torch"])
    cm = pipeline.jit(model, executors=["torch"], transforms=[checkpoint(policy)])
    assert torch.equal(llama_step(cm, tokens), llama_step(baseline, tokens))
    for (name, p), (_, q) in zip(model.named_parameters(), baseline_model.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert saved_activation_bytes(cm) < saved_activation_bytes(baseline)


def test_full_checkpoint_saves_less_than_selective():
    tokens = torch.randint(0, 256, (2, 16))
    saved = {}
    for policy in ("full", "selective"):
        torch.manual_seed(0)
        cm = pipeline.jit(Llama(LlamaConfig()), executors=["torch"], transforms=[checkpoint(policy)])
        llama_step(cm, tokens)
        saved[policy] = saved_activation_bytes(cm)
        joint = trace_named(cm, "g0_joint")
        assert joint.provenance[-1].name == f"checkpoint({policy})"
    assert saved["full"] < saved["selective"]


class CheckpointedDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(0.3)

    def block(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


@pytest.mark.parametrize("device,executor", [("cpu", "torch"), pytest.param("cuda", "torch", marks=pytest.mark.cuda),
                                             pytest.param("cuda", "inductor", marks=pytest.mark.cuda)])
def test_user_checkpoint_replays_the_forwards_dropout_masks_in_the_backward(device, executor):
    """The partitioner wraps a checkpoint's random ops to save and replay their RNG state; the wrappers compile (they
    fell back to Dynamo's graph run in eager, whose recompute drew other masks: wrong gradients behind a warning)."""
    torch.manual_seed(0)
    model, x = CheckpointedDropout().to(device), torch.randn(4, 8, device=device)
    eager = copy.deepcopy(model)
    cm = pipeline.jit(model, executors=[executor])
    for seed in (1, 2):
        torch.manual_seed(seed)
        cm(x).square().sum().backward()
        torch.manual_seed(seed)
        eager(x).square().sum().backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    wrappers = {stage: [n.target.__name__ for n in trace_named(cm, f"g0_{stage}", f"lower ({stage})").module.graph.nodes
                        if n.op == "call_function" and "rng_state" in str(n.target)] for stage in ("forward", "backward")}
    assert wrappers == {"forward": ["run_and_save_rng_state"], "backward": ["run_with_rng_state"]}
    stats = pipeline.compile_stats(cm)
    assert stats.eager_fallbacks == {} and stats.fallbacks == []


@pytest.mark.cuda
def test_user_checkpoint_around_dropout_with_cuda_graphs_runs_its_forward_unrecorded():
    """The RNG wrappers' state is a CPU tensor, so the forward is not recorded (with the reason); gradients stay eager's,
    including a backward that keeps its graph."""
    torch.manual_seed(0)
    model, x = CheckpointedDropout().cuda(), torch.randn(4, 8, device="cuda")
    eager = copy.deepcopy(model)
    cm = pipeline.jit(model, executors=["inductor"], cuda_graphs=True)
    for seed in (1, 2, 3):
        for m in (cm, eager):
            torch.manual_seed(seed)
            loss = m(x).square().sum()
            loss.backward(retain_graph=True)
            loss.backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    stats = pipeline.compile_stats(cm)
    assert stats.cuda_graphs["g0 forward"].startswith("off: a value off the GPU"), stats.cuda_graphs
    assert stats.eager_fallbacks == {} and stats.fallbacks == []


class NormedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpoint_saves_what_reads_a_buffer_the_forward_writes_back(policy):
    """A BatchNorm in training writes its running stats back after the forward; recomputed in the backward, its op read
    the new values (autograd refused: 'modified by an inplace operation'). It is saved instead."""
    torch.manual_seed(0)
    model, x = NormedMLP(), torch.randn(6, 8)
    eager = copy.deepcopy(model)
    cm = pipeline.jit(model, executors=["torch"], transforms=[checkpoint(policy)])
    for _ in range(2):
        cm(x).square().sum().backward()
        eager(x).square().sum().backward()
    for (name, p), (_, q) in zip(model.state_dict(keep_vars=True).items(), eager.state_dict(keep_vars=True).items()):
        torch.testing.assert_close(p, q, msg=name)
        if p.grad is not None or q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert pipeline.compile_stats(cm).fallbacks == []


def test_checkpoint_rejects_unknown_policy():
    with pytest.raises(ValueError, match="policy must be 'full', 'selective' or a function"):
        checkpoint("most")


# -- CPU offload -----------------------------------------------------------------------------------
def test_cpu_offload_keeps_results_and_shows_the_copies():
    model = Llama(LlamaConfig())
    eager = copy.deepcopy(model)
    tokens = torch.randint(0, 256, (2, 16))
    cm = pipeline.jit(model, executors=["torch"], transforms=[cpu_offload(min_bytes=4096)])
    assert torch.equal(llama_step(cm, tokens), llama_step(eager, tokens))
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    forward = trace_named(cm, "g0_forward", "cpu_offload")
    backward = trace_named(cm, "g0_backward", "cpu_offload")
    offloads = [n for n in forward.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    reloads = [n for n in backward.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert len(offloads) == len(reloads) > 0
    assert all(node_value(n.args[0]).numel() * 4 >= 4096 for n in offloads)


def test_passes_compose_in_order():
    model = Llama(LlamaConfig())
    eager = copy.deepcopy(model)
    tokens = torch.randint(0, 256, (2, 16))
    cm = pipeline.jit(model, executors=["torch"],
                      transforms=[mixed_precision("bf16"), checkpoint("selective"), cpu_offload(min_bytes=0)])
    loss = llama_step(cm, tokens)
    with torch.autocast("cpu", torch.bfloat16):
        logits = eager(tokens)
    torch.testing.assert_close(loss, next_token_loss(logits, tokens), rtol=2e-2, atol=2e-2)
    steps = [s.name for s in trace_named(cm, "g0_forward", "dispatch: compile or load regions").provenance]
    assert steps == ["capture", "mixed_precision(bf16)", "lower (forward)", "cpu_offload", "dispatch: assign claims", "dispatch: keep fusible islands whole", "dispatch: partition", "dispatch: compile or load regions"]
    assert trace_named(cm, "g0_joint").provenance[-1].name == "checkpoint(selective)"


@pytest.mark.cuda
def test_cpu_offload_frees_device_memory_between_forward_and_backward():
    torch.manual_seed(0)
    config = LlamaConfig(vocab=1024, dim=512, layers=2, heads=8, kv_heads=4, hidden=1408, max_seq=512)
    tokens = torch.randint(0, 1024, (4, 512), device="cuda")
    held = {}
    for offload in (False, True):
        torch._dynamo.reset()
        model = Llama(config).cuda()
        cm = pipeline.jit(model, executors=["torch"], transforms=[cpu_offload()] if offload else [])
        next_token_loss(cm(tokens), tokens).backward()  # compile
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        loss = next_token_loss(cm(tokens), tokens)
        torch.cuda.synchronize()
        held[offload] = torch.cuda.memory_allocated() - base
        loss.backward()
        if offload:
            forward = trace_named(cm, "g0_forward", "cpu_offload")
            offloaded = sum(node_value(n.args[0]).numel() * node_value(n.args[0]).element_size()
                            for n in forward.graph.nodes if n.target is torch.ops.aten._to_copy.default)
    assert offloaded > 0
    assert held[False] - held[True] >= 0.9 * offloaded
