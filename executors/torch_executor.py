"""The `torch` executor: runs a region's ATen ops one by one with eager's own kernels.

It claims every op, so it is also the fallback that runs whatever no listed executor claims.
"""
from __future__ import annotations

from typing import Sequence

import torch.fx as fx

from .base import Executor


class TorchExecutor(Executor):
    name = "torch"
    kind = "fusion"  # it takes whole regions, but compiles nothing: the region runs op by op

    def claims_op(self, op, node: fx.Node) -> bool:
        return True

    def compile_region(self, gm: fx.GraphModule, example_inputs: Sequence):
        return gm.forward

    # Nothing compiled, nothing to store: a cached region is rebuilt from its graph.
    def artifact_unsupported_reason(self, gm, example_inputs):
        return None

    def save_region(self, fn) -> bytes:
        return b""

    def load_region(self, data: bytes, gm: fx.GraphModule, example_inputs: Sequence):
        return gm.forward


torch_executor = TorchExecutor()
