"""The `torch` executor: a region's ATen ops one by one, with eager's kernels; claiming every op, it is the fallback."""

from typing import Sequence

import torch.fx as fx

from .base import RebuiltFromGraph
from .graph_utils import keep_promised_strides, meta_strides_unreliable, promised_strides


class TorchExecutor(RebuiltFromGraph):
    name = "torch"
    kind = "fusion"  # it takes whole regions, but compiles nothing: the region runs op by op

    def claims_op(self, op, node: fx.Node) -> bool:
        return True

    def compile_region(self, gm: fx.GraphModule, example_inputs: Sequence):
        """`gm.forward`; with ops of unreliable fake strides, outputs copied into the strides promised other regions."""
        if not any(meta_strides_unreliable(n) for n in gm.graph.nodes):
            return gm.forward
        promised = promised_strides(gm)

        def run(*args):
            return tuple(keep_promised_strides(list(gm(*args)), promised))
        return run


torch_executor = TorchExecutor()
