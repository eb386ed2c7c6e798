"""`pipeline.save` / `pipeline.load`: a jitted model's (and its optimizer's) state through safetensors.

Unsharded, `path` is one file: the original model's state dict under `model.<key>` (an eager copy of
the model loads it: `load_full(path)`), the optimizer's tensors under `optimizer.state.<index>.<name>`,
its hyperparameters as JSON in the file's metadata.

Under `fsdp`, `path` is a folder and each rank writes and reads only its part,
`rank<r>-of-<w>.safetensors`: the rows of every sharded tensor it holds (and their optimizer state),
plus, from rank 0, what is not sharded. `load_full(path)` puts the full tensors back together.
Files are read tensor by tensor (`safe_open`), never whole.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Optional

import torch

MODEL, OPTIMIZER = "model.", "optimizer.state."


def save(cm, path: str, *, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Writes the model's state (and the optimizer's) to `path`; see the module docstring."""
    from safetensors.torch import save_file

    sharded = _sharded(cm)
    rank, world = _rank_world(sharded)
    tensors, metadata, rows = {}, {"format": "pt"}, {}
    if sharded:
        for qualname, r in sharded.items():
            start, stop = r.transform.rows(r.original)
            tensors[MODEL + qualname] = _storable(r.tensors["shard"][: stop - start], qualname)
            rows[qualname] = [start, stop]
        if rank == 0:
            for key, value in cm._original.state_dict().items():
                if key not in sharded:
                    tensors[MODEL + key] = _storable(value, key)
    else:
        for key, value in cm.state_dict().items():
            tensors[MODEL + key] = _storable(value, key)
    if optimizer is not None:
        metadata["optimizer"] = _save_optimizer(cm, optimizer, sharded, tensors)
    metadata["rows"] = json.dumps(rows)
    if sharded:
        os.makedirs(path, exist_ok=True)
        path = os.path.join(path, f"rank{rank}-of-{world}.safetensors")
    save_file(tensors, path, metadata=metadata)


def load(cm, path: str, *, optimizer: Optional[torch.optim.Optimizer] = None, strict: bool = True):
    """Loads what `save` wrote into `cm` (and `optimizer`); under fsdp each rank reads its own file
    (and rank 0's unsharded tensors)."""
    from safetensors import safe_open

    sharded = _sharded(cm)
    if not sharded:
        state, optimizer_state, metadata = _read(path, optimizer is not None)
        result = cm.load_state_dict(state, strict=strict)
    else:
        rank, world = _rank_world(sharded)
        own = os.path.join(path, f"rank{rank}-of-{world}.safetensors")
        if not os.path.exists(own):
            raise FileNotFoundError(f"{own} is missing: {path} was not saved by {world} ranks "
                                    f"(resharding to another world size is not supported yet)")
        state, optimizer_state, metadata = _read(own, optimizer is not None)
        with torch.no_grad():
            for qualname, r in sharded.items():
                part = state.pop(qualname)
                r.tensors["shard"].zero_()
                r.tensors["shard"][: part.shape[0]].copy_(part)
        if rank != 0:
            with safe_open(os.path.join(path, f"rank0-of-{world}.safetensors"), framework="pt") as f:
                state.update({k[len(MODEL):]: f.get_tensor(k) for k in f.keys()
                              if k.startswith(MODEL) and k[len(MODEL):] not in sharded})
        result = cm._original.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if k not in sharded]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"load: missing keys {missing}, unexpected keys {result.unexpected_keys}")
    if optimizer is not None:
        if "optimizer" not in metadata:
            raise ValueError(f"{path} holds no optimizer state; it was saved without optimizer=")
        _load_optimizer(cm, optimizer, sharded, optimizer_state, json.loads(metadata["optimizer"]))
    return result


def load_full(path: str) -> dict[str, torch.Tensor]:
    """The original model's full state dict from what `save` wrote (one file, or a folder of rank
    files), for an eager copy of the model: `model.load_state_dict(pipeline.load_full(path))`."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "rank*-of-*.safetensors"))) if os.path.isdir(path) else [path]
    if not files:
        raise FileNotFoundError(f"{path} holds no rank files")
    parts: dict[str, list] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            rows = json.loads((f.metadata() or {}).get("rows", "{}"))
            for key in f.keys():
                if key.startswith(MODEL):
                    name = key[len(MODEL):]
                    parts.setdefault(name, []).append((rows.get(name, [0])[0], f.get_tensor(key)))
    return {name: torch.cat([t for _, t in sorted(p, key=lambda x: x[0])]) if len(p) > 1 else p[0][1]
            for name, p in parts.items()}


def _read(path, with_optimizer):
    from safetensors import safe_open
    state, optimizer_state = {}, {}
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        for key in f.keys():
            if key.startswith(MODEL):
                state[key[len(MODEL):]] = f.get_tensor(key)
            elif key.startswith(OPTIMIZER) and with_optimizer:
                index, name = key[len(OPTIMIZER):].split(".", 1)
                optimizer_state.setdefault(int(index), {})[name] = f.get_tensor(key)
    return state, optimizer_state, metadata


def _save_optimizer(cm, optimizer, sharded, tensors) -> str:
    state = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    live_rows = _live_rows(cm, sharded)
    scalars: dict[str, dict[str, object]] = {}
    for index, entries in state["state"].items():
        keep = live_rows.get(id(params[index]))
        for name, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                value = value[:keep] if keep is not None else value
                tensors[f"{OPTIMIZER}{index}.{name}"] = _storable(value, f"optimizer state {index}.{name}")
            else:
                scalars.setdefault(str(index), {})[name] = value.item() if isinstance(value, torch.Tensor) else value
    return json.dumps({"param_groups": state["param_groups"], "scalars": scalars})


def _load_optimizer(cm, optimizer, sharded, tensors, saved) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict] = {}
    for index, entries in tensors.items():
        param = params[index]
        for name, value in entries.items():
            if value.shape[0] != param.shape[0] and value.dim() == param.dim():  # a shard without its padding
                value = torch.cat([value, value.new_zeros((param.shape[0] - value.shape[0], *value.shape[1:]))])
            state.setdefault(index, {})[name] = value
    for index, scalars in saved["scalars"].items():
        for name, value in scalars.items():
            state.setdefault(int(index), {})[name] = torch.tensor(float(value)) if name == "step" else value
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def _live_rows(cm, sharded) -> dict[int, int]:
    """id(shard parameter) -> how many of its rows are real (not padding)."""
    out = {}
    for r in sharded.values():
        start, stop = r.transform.rows(r.original)
        out[id(r.tensors["shard"])] = stop - start
    return out


def _sharded(cm) -> dict:
    state = getattr(cm, "_state", None)
    replaced = getattr(state, "replaced", {}) or {}
    return {q: r for q, r in replaced.items() if hasattr(r.transform, "rows") and r.transform.world > 1}


def _rank_world(sharded) -> tuple[int, int]:
    if not sharded:
        return 0, 1
    t = next(iter(sharded.values())).transform
    return t.rank, t.world


def _storable(value, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"cannot save {what}: it is a {type(value).__name__}, not a tensor; "
                        f"safetensors stores tensors only")
    return value.detach().cpu().contiguous().clone()  # clone: tied weights must not share storage
