"""Region cache keys, hashes of what a region's compiled code depends on: `structure_key` finds identical regions (one
layer down, compiled once) and binds a cached artifact to its graph; `region_key` keys the artifact cache."""

import hashlib
import operator
from typing import Sequence

import torch
import torch.fx as fx

from ir import node_value


def structure_key(source: fx.GraphModule) -> str:
    """A hash of what a region's code depends on, names aside: each node's op, target, arguments by position, values'
    metadata (shapes, strides, dtypes, donation), constants' bytes. Identical layers hash alike: one compiles."""
    index: dict[fx.Node, str] = {}
    parts = []
    for node in source.graph.nodes:
        index[node] = f"%{len(index)}"
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: index[n])
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(source)
            if isinstance(value, fx.GraphModule):  # a higher-order op's body: its own structure, nested bodies too
                meta = f"graph {structure_key(value)}"
            else:
                meta = value_signature(value) + (f" {tensor_digest(value)}" if isinstance(value, torch.Tensor) else "")
        else:
            meta = _value_signatures(node_value(node)) + (" donated" if node.meta.get("donated") else "")
        parts.append(f"{node.op} {node.target if node.op in ('call_function', 'call_method') else ''} {args!r} {meta}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def region_key(structure: str, order: Sequence, *modes: str) -> str:
    """The artifact-cache key: the region's `structure_key`, each candidate executor's `cache_token`, `modes`."""
    return hashlib.sha256("\n".join([structure, *(e.cache_token() for e in order), *modes]).encode()).hexdigest()


def _value_signatures(v) -> str:
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_value_signatures(x) for x in v) + ")"
    return value_signature(v) if v is not None else "-"


def value_signature(v) -> str:
    """A tensor's metadata (or a value's type and text) as it enters a cache key."""
    if isinstance(v, torch.Tensor):
        return (f"{v.dtype} {v.device} {tuple(v.shape)} {tuple(v.stride())} {v.storage_offset()} "
                f"grad={v.requires_grad} {v.layout} {type(v).__name__}")
    return f"{type(v).__name__} {v}"


def tensor_digest(t: torch.Tensor) -> str:
    """A hash of a tensor's bytes (a constant baked into compiled code)."""
    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
