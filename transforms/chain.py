"""`chain(a, b, ...)`: model transforms applied in turn, as one (docs/passes.md). Two compose when the later can encode
each tensor the earlier makes and keeps no `extra` state (it would describe intermediate tensors)."""

import functools
from typing import Optional

import torch

from .base import pass_factory
from .model_transform import ModelTransform


class Chain(ModelTransform):
    def __init__(self, first: ModelTransform, then: ModelTransform):
        self.first, self.then = first, then
        self.name, self.extra = f"{first.name}→{then.name}", first.extra
        self.trainable, self.rowwise = first.trainable and then.trainable, first.rowwise and then.rowwise

    def parts(self) -> list[ModelTransform]:
        return self.first.parts() + self.then.parts()

    def applies_to(self, module, qualname, param) -> bool:
        return any(p.applies_to(module, qualname, param) for p in self.parts())

    def check(self, qualname: str, original: torch.Tensor) -> None:
        """Raises if `then` cannot take what `first` produces for parameter `qualname`."""
        for suffix, mid in self._mids(original).items():
            if (why := self.then.cannot_encode(mid)) is None and self.then.extra:
                why = f"it would keep its own state ({', '.join(self.then.extra)}) for an intermediate tensor"
            if why is not None:
                raise ValueError(f"{qualname}: {self.then.name} cannot follow {self.first.name}: on the {tuple(mid.shape)} {mid.dtype} "
                                 f"tensor '{suffix}' {self.first.name} produces, {why}. Reorder the transforms or leave one out for it.")

    def _mids(self, original) -> dict[str, torch.Tensor]:
        """What `first` produces for `original`, as meta tensors (shapes and dtypes)."""
        return self.first.encode(torch.empty(original.shape, dtype=original.dtype, device="meta"))

    @staticmethod
    def _group(tensors: dict, suffix: str) -> dict:
        """`then`'s tensors for `first`'s tensor `suffix`: `q.shard` -> `shard`."""
        return {k[len(suffix) + 1:]: v for k, v in tensors.items() if k.startswith(suffix + ".")}

    def encode(self, value, like=None):
        mid = self.first.encode(value, like)
        return {f"{s}.{s2}": t2 for s, t in mid.items() for s2, t2 in self.then.encode(t).items()}

    def decode(self, tensors, original):
        mid = {s: self.then.decode(self._group(tensors, s), m) for s, m in self._mids(original).items()}
        return self.first.decode(mid, original)

    def extra_state(self, tensors, original):
        mids = self._mids(original)
        mid = {s: self.then.decode(self._group(tensors, s), mids[s]) for s in self.first.extra}
        return self.first.extra_state(mid, original)

    def rebuild(self, graph, inputs, original):
        mid = {s: self.then.rebuild(graph, self._group(inputs, s), m) for s, m in self._mids(original).items()}
        return self.first.rebuild(graph, mid, original)

    def passes(self):
        unique = {}  # by name, in order: the first of each
        for p in self.first.passes() + self.then.passes():
            unique.setdefault(p.name, p)
        return list(unique.values())

    # Row shards (sharded checkpoints): `then` shards rows, `first` works row by row, so this rank's
    # rows of the original are `first` applied to this rank's rows of `first`'s tensors.
    def row_shard(self, original):
        return self.then.row_shard(original) if self.first.rowwise else None

    def from_rows(self, rows, original):
        mid = self.first.encode(rows[""], {s: t for s, t in rows.items() if s} or None)
        mids = self._mids(original)
        return {f"{s}.{s2}": t2 for s, t in mid.items() for s2, t2 in self.then.from_rows({"": t}, mids[s]).items()}

    def local_rows(self, tensors, original):
        local = {s: self.then.local_rows(self._group(tensors, s), m)[""] for s, m in self._mids(original).items()}
        start, stop = self.row_shard(original)
        part = torch.empty((stop - start, *original.shape[1:]), dtype=original.dtype, device="meta")
        return {"": self.first.decode(local, part).to(original.dtype), **self.first.extra_state(local, part)}


def for_parameter(transforms: list[ModelTransform], module, qualname: str, param) -> Optional[ModelTransform]:
    """The `transforms` (chains flattened) applying to parameter `qualname`, chained, checked to compose; or None."""
    if not (parts := [p for t in transforms for p in t.parts() if p.applies_to(module, qualname, param)]):
        return None
    transform = parts[0]
    for part in parts[1:]:
        transform = Chain(transform, part)
        transform.check(qualname, param)
    return transform


@pass_factory
def chain(*transforms: ModelTransform) -> ModelTransform:
    """The model transforms applied in order, as one (what `transforms=[...]` does with several)."""
    if not transforms:
        raise ValueError("chain: give at least one model transform")
    return functools.reduce(Chain, transforms)
