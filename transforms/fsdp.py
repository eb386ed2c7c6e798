"""`fsdp(process_group=None)`: fully sharded data parallelism over `torch.distributed`: each rank
holds and trains its dim-0 shard of every trainable parameter (docs/passes.md, "Model-changing transforms")."""

import math
import operator

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ir import Trace, fake_like, node_value
from ir.rewrite import add_call

from .base import TracePass, pass_factory
from .model_transform import ModelTransform


class FSDP(ModelTransform):
    trainable = True
    targets = "floating-point parameters of one dim or more that require grad"

    def __init__(self, process_group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("fsdp needs torch.distributed initialised (torchrun, or init_process_group) "
                               "before pipeline.jit")
        self.group = process_group or dist.group.WORLD
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.name = f"fsdp({self.world} ranks)"

    def applies_to(self, module, qualname, param) -> bool:
        return param.is_floating_point() and param.requires_grad and param.dim() >= 1

    def cannot_encode(self, value):
        return "it shards along dim 0 and a 0-d tensor has none" if value.dim() == 0 else None

    def rows(self, original) -> tuple[int, int]:
        """The rows [start, stop) of the original parameter this rank holds."""
        n, per = original.shape[0], math.ceil(original.shape[0] / self.world)
        return min(self.rank * per, n), min((self.rank + 1) * per, n)

    def row_shard(self, original):
        return self.rows(original) if self.world > 1 else None

    def encode(self, value, like=None):
        start, stop = self.rows(value)
        return self.from_rows({"": value[start:stop]}, value)

    def from_rows(self, rows, original):
        """This rank's rows, padded with zero rows to ceil(n / world)."""
        part = rows[""]
        shard = part.new_zeros((math.ceil(original.shape[0] / self.world), *original.shape[1:]))
        shard[: part.shape[0]] = part
        return {"shard": shard}

    def local_rows(self, tensors, original):
        start, stop = self.rows(original)
        return {"": tensors["shard"][: stop - start]}

    def decode(self, tensors, original):
        shard = tensors["shard"].detach()
        full = shard.new_empty((shard.shape[0] * self.world, *shard.shape[1:]))
        dist.all_gather_into_tensor(full, shard.contiguous(), group=self.group)
        return full[: original.shape[0]]

    def rebuild(self, graph: fx.Graph, inputs, original):
        import torch.distributed._functional_collectives as fcol
        shard, fake_shard = inputs["shard"], node_value(inputs["shard"])
        trained = fake_shard.requires_grad  # frozen tensors (e.g. quantized weights) need no gradient path
        gather = ((getattr(fcol, "all_gather_single_autograd", None) or fcol.all_gather_tensor_autograd)
                  if trained else fcol.all_gather_tensor)
        gathered = add_call(graph, gather, (shard, 0, self.group.group_name),
                            fake_like(fake_shard, (fake_shard.shape[0] * self.world, *fake_shard.shape[1:])))
        full = add_call(graph, fcol.wait_tensor, (gathered,), gathered.meta["val"])
        if gathered.meta["val"].shape[0] != original.shape[0]:
            full = add_call(graph, "narrow", (full, 0, 0, original.shape[0]), fake_like(fake_shard, original.shape))
        if trained:  # value unchanged (x + 0); gradient scaled by 1/world: the ranks' mean, as one whole batch
            detached = add_call(graph, "detach", (full,), fake_like(fake_shard, original.shape))
            delta = add_call(graph, operator.sub, (full, detached), fake_like(fake_shard, original.shape))
            scaled = add_call(graph, operator.mul, (delta, 1.0 / self.world), fake_like(fake_shard, original.shape))
            full = add_call(graph, operator.add, (detached, scaled), fake_like(fake_shard, original.shape))
        return full

    def passes(self):
        return [TracePass(regather_in_backward, runs_on="joint", name="fsdp.regather_in_backward")]


def regather_in_backward(trace: Trace) -> Trace:
    """Marks the ops rebuilding full parameters from shards for recomputation: the backward gathers again."""
    gm = trace.editable()
    derived = {n for n, spec in zip(gm.graph.nodes, trace.inputs)  # the shards, then what only they compute
               if n.op == "placeholder" and spec.qualname and spec.qualname.endswith(".shard")}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in derived:
            continue
        tensor_inputs = [a for a in node.all_input_nodes if isinstance(node_value(a), torch.Tensor)]
        if tensor_inputs and all(a in derived for a in tensor_inputs):
            derived.add(node)
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return trace.derive(gm, by="fsdp.regather_in_backward")


@pass_factory
def fsdp(process_group=None) -> FSDP:
    """Shard every trainable parameter along dim 0 across `process_group` (default: the world)."""
    return FSDP(process_group)
