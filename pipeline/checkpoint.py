"""`pipeline.save` / `pipeline.load`: a jitted model's (and its optimizer's) state in safetensors (what loads where, and
the rank files under `fsdp`: docs/passes.md, "Checkpoints"). Keys: `model.<key>`, the optimizer's tensors under
`optimizer.state.<index>.<name>`, its hyperparameters as JSON in the metadata, each rank file's rows in `rows`."""

import contextlib
import glob
import json
import os
import re
from typing import Optional

import torch

from . import model_state

MODEL, OPTIMIZER = "model.", "optimizer.state."


def save(cm, path: str, *, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Writes the model's state (and the optimizer's) to `path`; see the module docstring."""
    from safetensors.torch import save_file

    sharded = _row_sharded(cm)
    rank, world, group = _rank_world(sharded)
    tensors, metadata, rows = {}, {"format": "pt"}, {}
    for qualname, r in sharded.items():
        keys = {"": qualname, **r.extra_keys()}
        for suffix, value in r.transform.local_rows(r.tensors, r.original).items():
            tensors[MODEL + keys[suffix]] = _storable(value, keys[suffix])
            rows[MODEL + keys[suffix]] = list(r.transform.row_shard(r.original))
    rest = _unsharded_state(cm, sharded) if sharded else cm.state_dict()  # every rank: decoding may gather
    if rank == 0:  # rank 0's file (or the only file) holds them
        tensors.update({MODEL + k: _storable(v, k) for k, v in rest.items()})
    if optimizer is not None:
        metadata["optimizer"] = _save_optimizer(cm, optimizer, tensors, rows)
    metadata["rows"] = json.dumps(rows)
    if sharded:
        os.makedirs(path, exist_ok=True)
        path = os.path.join(path, f"rank{rank}-of-{world}.safetensors")
    save_file(tensors, path, metadata=metadata)
    if world > 1:  # no rank returns before every rank file is whole: a load right after reads them all
        torch.distributed.barrier(group)


def load(cm, path: str, *, optimizer: Optional[torch.optim.Optimizer] = None, strict: bool = True):
    """Loads what `save` wrote (on any number of ranks) into `cm` (and `optimizer`), reading only this rank's rows."""
    sharded = _row_sharded(cm)
    with Checkpoint(path) as ckpt:
        if optimizer is not None and "optimizer" not in ckpt.metadata:
            raise ValueError(f"{path} holds no optimizer state; it was saved without optimizer=")
        owned, absent = set(), []
        for qualname, r in sharded.items():
            keys = {"": qualname, **r.extra_keys()}
            owned |= {MODEL + k for k in keys.values()}
            if MODEL + qualname not in ckpt:
                absent.append(qualname)
                continue
            model_state.check_shape(f"load {path}", qualname, ckpt.shape(MODEL + qualname), r)
            start, stop = r.transform.row_shard(r.original)
            part = {s: ckpt.read(MODEL + k, start, stop) for s, k in keys.items() if MODEL + k in ckpt}
            with torch.no_grad():
                for suffix, value in r.transform.from_rows(part, r.original).items():
                    r.tensors[suffix].copy_(value)
        state = {k[len(MODEL):]: ckpt.read(k) for k in ckpt.keys() if k.startswith(MODEL) and k not in owned}
        result = cm.load_state_dict(state, strict=False)  # the row-sharded ones were read above
        result = type(result)(absent + [k for k in result.missing_keys if k not in sharded], result.unexpected_keys)
        if strict and (result.missing_keys or result.unexpected_keys):
            raise RuntimeError(f"load: {path} lacks {result.missing_keys[:5]}, has unexpected {result.unexpected_keys[:5]}")
        if optimizer is not None:
            _load_optimizer(cm, optimizer, ckpt, json.loads(ckpt.metadata["optimizer"]))
    return result


def load_full(path: str) -> dict[str, torch.Tensor]:
    """The original model's full state dict from what `save` wrote, for an eager copy of the model."""
    with Checkpoint(path) as ckpt:
        return {k[len(MODEL):]: ckpt.read(k) for k in ckpt.keys() if k.startswith(MODEL)}


class Checkpoint(contextlib.ExitStack):
    """The tensors `save` wrote, whole in a file or as row parts over rank files; `read(key, start, stop)` gets rows."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.files = sorted(glob.glob(os.path.join(path, "rank*-of-*.safetensors"))) if os.path.isdir(path) else [path]
        if not self.files:
            raise FileNotFoundError(f"{path} holds no rank files")
        worlds = {int(re.search(r"-of-(\d+)\.safetensors$", f).group(1)) for f in self.files} if os.path.isdir(path) else {1}
        if len(worlds) > 1:
            raise ValueError(f"{path} mixes files saved by {sorted(worlds)} ranks; keep one save per folder")
        if len(self.files) != (world := worlds.pop()):  # a save still being written, or a file lost
            raise ValueError(f"{path} holds {len(self.files)} of the {world} rank files its save wrote")
        self.metadata, self.whole, self.parts = {}, {}, {}  # whole: key -> file; parts: key -> [(start, stop, file)]

    def __enter__(self):
        from safetensors import safe_open
        super().__enter__()
        for file in self.files:
            f = self.enter_context(safe_open(file, framework="pt"))
            metadata = f.metadata() or {}
            self.metadata = self.metadata or metadata
            rows = json.loads(metadata.get("rows", "{}"))
            for key in f.keys():
                if key in rows:
                    self.parts.setdefault(key, []).append((*rows[key], f))
                else:
                    self.whole.setdefault(key, f)
        return self

    def keys(self) -> list[str]:
        return list(self.whole) + [k for k in self.parts if k not in self.whole]

    def __contains__(self, key: str) -> bool:
        return key in self.whole or key in self.parts

    def shape(self, key: str) -> tuple:
        if key in self.whole:
            return tuple(self.whole[key].get_slice(key).get_shape())
        return (max(p[1] for p in self.parts[key]), *self.parts[key][0][2].get_slice(key).get_shape()[1:])

    def read(self, key: str, start: Optional[int] = None, stop: Optional[int] = None) -> torch.Tensor:
        """Rows [start, stop) of tensor `key` (all of it by default)."""
        if key in self.whole:  # a slice of a 0-dim tensor (BatchNorm's num_batches_tracked) cannot be taken
            return self.whole[key].get_tensor(key) if start is None else self.whole[key].get_slice(key)[start:stop]
        parts = sorted(self.parts[key], key=lambda p: p[0])
        if start is None:
            start, stop = 0, max(p[1] for p in parts)
        pieces = [f.get_slice(key)[max(start, a) - a: min(stop, b) - a] for a, b, f in parts if a < stop and b > start]
        return torch.cat(pieces) if pieces else parts[0][2].get_slice(key)[0:0]


def _unsharded_state(cm, sharded) -> dict:
    """The state dict without the row-sharded parameters (and their extra state)."""
    replaced = {q: r for q, r in cm._state.config.replaced.items() if q not in sharded}
    out = model_state.state_dict(cm._original.state_dict(), replaced, cm._state.config.executors)
    return {k: v for k, v in out.items() if k not in sharded}


def _save_optimizer(cm, optimizer, tensors, rows) -> str:
    state = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    param_rows, scalars = _param_rows(cm), {}
    for index, entries in state["state"].items():
        held = param_rows.get(id(params[index]))
        for name, value in entries.items():
            key = f"{OPTIMIZER}{index}.{name}"
            if isinstance(value, torch.Tensor) and (value.dim() > 0 or name != "step"):  # a 0-dim param's exp_avg too
                if held is not None:
                    if value.shape != params[index].shape:  # only states shaped like their shard split by rows
                        raise NotImplementedError(
                            f"pipeline.save: optimizer state {name!r} of parameter {index} has shape {tuple(value.shape)}, "
                            f"not its shard's {tuple(params[index].shape)}; sharded checkpoints split optimizer state by the "
                            f"parameter's rows ({type(optimizer).__name__} is not supported under fsdp; AdamW, Adam and SGD are)")
                    value = value[: held[1] - held[0]]
                    rows[key] = list(held)
                tensors[key] = _storable(value, f"optimizer state {index}.{name}")
            else:
                scalars.setdefault(str(index), {})[name] = value.item() if isinstance(value, torch.Tensor) else value
    return json.dumps({"param_groups": state["param_groups"], "scalars": scalars})


def _load_optimizer(cm, optimizer, ckpt: Checkpoint, saved) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    param_rows, state = _param_rows(cm), {}
    for key in (k for k in ckpt.keys() if k.startswith(OPTIMIZER)):
        index, name = key[len(OPTIMIZER):].split(".", 1)
        held = param_rows.get(id(param := params[int(index)]))
        value = ckpt.read(key, *held) if held is not None else ckpt.read(key)
        if held is not None and value.dim() == param.dim() and value.shape[0] < param.shape[0]:  # pad the shard
            value = torch.cat([value, value.new_zeros((param.shape[0] - value.shape[0], *value.shape[1:]))])
        if value.dim() == param.dim() and value.shape != param.shape:
            raise ValueError(f"load: optimizer state {name} of parameter {index} is {tuple(value.shape)} in "
                             f"{ckpt.path}, the parameter is {tuple(param.shape)}")
        state.setdefault(int(index), {})[name] = value
    for index, scalars in saved["scalars"].items():
        for name, value in scalars.items():
            state.setdefault(int(index), {})[name] = torch.tensor(float(value)) if name == "step" else value
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def _param_rows(cm) -> dict[int, tuple[int, int]]:
    """id(tensor) -> the rows [start, stop) it holds of its full tensor, for row-sharded tensors."""
    return {id(t): r.transform.row_shard(r.original) for r in _row_sharded(cm).values() for t in r.tensors.values()}


def _row_sharded(cm) -> dict:
    """The replaced parameters of which this rank holds only some rows."""
    replaced = cm._state.config.replaced if hasattr(cm, "_state") else {}
    return {q: r for q, r in replaced.items() if r.transform.row_shard(r.original) is not None}


def _rank_world(sharded) -> tuple[int, int, object]:
    if not sharded:
        return 0, 1, None
    t = next(iter(sharded.values())).transform
    while hasattr(t, "then"):  # a chain: the sharding transform comes last
        t = t.then
    return t.rank, t.world, getattr(t, "group", None)


def _storable(value, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"cannot save {what}: it is a {type(value).__name__}, not a tensor; "
                        f"safetensors stores tensors only")
    return value.detach().cpu().contiguous().clone()  # clone: tied weights must not share storage
