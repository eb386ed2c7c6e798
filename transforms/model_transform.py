"""`ModelTransform`: a transform that changes parameters and the graph together (stage 2).

Dynamo still captures the original module; the transform then
  - replaces some parameters by new tensors (`encode`: e.g. an int8 weight and its scales),
  - rewrites the captured trace so each replaced parameter's placeholder becomes placeholders for
    the new tensors plus the ops that rebuild the original value from them (`rebuild`), and
  - maps state dicts both ways (`decode` for saving the original keys, `encode` for loading).
The compiled code runs on the new tensors; `cm.parameters()` returns them.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx


class ModelTransform:
    name = "model_transform"
    trainable = False  # whether the new tensors are trained (FSDP shards) or frozen (quantized weights)

    def applies_to(self, module: torch.nn.Module, qualname: str, param: torch.Tensor) -> bool:
        """Whether this transform replaces parameter `qualname` (owned by `module`)."""
        raise NotImplementedError

    def encode(self, value: torch.Tensor, like: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
        """The new tensors standing for `value`, by suffix. `like`: the current ones, whose
        transform-owned state (e.g. scales) loading a state dict keeps."""
        raise NotImplementedError

    def encode_slices(self, source, original: torch.Tensor) -> dict[str, torch.Tensor]:
        """`encode` for a parameter still on the meta device, read from a safetensors slice `source`
        (`source[a:b]` reads rows a..b). The default reads it whole; FSDP reads only its shard."""
        return self.encode(source[:])

    def decode(self, tensors: dict[str, torch.Tensor], original: torch.Tensor) -> torch.Tensor:
        """The original parameter's value from the new tensors (`original`: its shape and dtype)."""
        raise NotImplementedError

    def rebuild(self, graph: fx.Graph, inputs: dict[str, fx.Node], original: torch.Tensor) -> fx.Node:
        """Inserts (at the graph's current insertion point) the torch-level ops computing the original
        value from the new tensors' placeholders; sets their metadata."""
        raise NotImplementedError

    def passes(self) -> list:
        """Trace passes this transform needs (e.g. FSDP's joint-graph recompute tags)."""
        return []

    def extra_state(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Transform-owned tensors a state dict carries under `<module>._extra_state.<suffix>`."""
        return {}
