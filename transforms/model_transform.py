"""`ModelTransform`: changes parameters and the graph together (docs/passes.md). One holding only some rows (dim 0) of a
parameter on this rank (FSDP) says which (`row_shard`), so sharded checkpoints save and load each rank's rows."""

from typing import Optional

import torch
import torch.fx as fx


class ModelTransform:
    name = "model_transform"
    trainable = False  # whether the new tensors are trained (FSDP shards) or frozen (quantized weights)
    extra: tuple[str, ...] = ()  # suffixes of new tensors a state dict carries (`_extra_state`), e.g. scales
    targets = "parameters"  # what `applies_to` accepts, for the error when it accepts nothing in a model
    rowwise = False  # encode/decode treat each row (dim 0) on its own, so they commute with row sharding

    def applies_to(self, module: torch.nn.Module, qualname: str, param: torch.Tensor) -> bool:
        """Whether this transform replaces parameter `qualname` (owned by `module`)."""
        raise NotImplementedError

    def refuses(self, module: torch.nn.Module, param: torch.Tensor) -> Optional[str]:
        """Why this transform will not replace `param` of `module`, or None: one whose new tensors are
        frozen refuses a module in train() mode (`requires_grad` alone is no refusal: it is the default)."""
        return "its module is in train() mode" if not self.trainable and module.training else None

    def cannot_encode(self, value: torch.Tensor) -> Optional[str]:
        """Why `value` (a meta tensor) cannot be encoded, or None; checked on what a chain hands over."""
        return None

    def encode(self, value: torch.Tensor, like: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
        """The new tensors standing for `value`, by suffix. `like`: transform-owned state (the `extra`
        tensors, e.g. scales) from a state dict being loaded, which the encoding keeps."""
        raise NotImplementedError

    def encode_slices(self, source, original: torch.Tensor) -> dict[str, torch.Tensor]:
        """`encode` from a safetensors slice (`source[a:b]`: rows a..b), only this rank's rows under a row shard."""
        rows = self.row_shard(original)
        return self.encode(source[:]) if rows is None else self.from_rows({"": source[rows[0]:rows[1]]}, original)

    def decode(self, tensors: dict[str, torch.Tensor], original: torch.Tensor) -> torch.Tensor:
        """The original parameter's value from the new tensors (`original`: its shape and dtype)."""
        raise NotImplementedError

    def rebuild(self, graph: fx.Graph, inputs: dict[str, fx.Node], original: torch.Tensor) -> fx.Node:
        """Inserts (at the insertion point) the torch-level ops computing the original value, with metadata."""
        raise NotImplementedError

    def parts(self) -> list["ModelTransform"]:
        """The transforms this one is made of, in order (a `Chain` has several)."""
        return [self]

    def passes(self) -> list:
        """Trace passes this transform needs (e.g. FSDP's joint-graph recompute tags)."""
        return []

    def extra_state(self, tensors: dict[str, torch.Tensor], original: torch.Tensor) -> dict[str, torch.Tensor]:
        """Transform-owned tensors a state dict carries under `<module>._extra_state.<attr>_<suffix>`."""
        return {s: tensors[s] for s in self.extra}

    def row_shard(self, original: torch.Tensor) -> Optional[tuple[int, int]]:
        """The rows [start, stop) of the original value this rank holds, when it holds only those."""
        return None

    def from_rows(self, rows: dict[str, torch.Tensor], original: torch.Tensor) -> dict[str, torch.Tensor]:
        """New tensors from this rank's rows (`row_shard`): the original's `rows[""]`, extra state's `rows[suffix]`."""
        raise NotImplementedError(f"{self.name} holds no row shards")

    def local_rows(self, tensors: dict[str, torch.Tensor], original: torch.Tensor) -> dict[str, torch.Tensor]:
        """The inverse of `from_rows`: this rank's rows of the original value and of the extra state."""
        raise NotImplementedError(f"{self.name} holds no row shards")
