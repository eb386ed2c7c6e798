"""`pipeline.save` / `pipeline.load`: a jitted model's (and its optimizer's) state through safetensors.

The file holds the original model's state dict under `model.<key>` (so it loads into an eager copy of
the model too: `safetensors.torch.load_file` and strip the prefix) and, when given, the optimizer's
tensors under `optimizer.state.<param index>.<name>`, with its hyperparameters as JSON in the file's
metadata. Loading reads tensors one at a time (`safe_open`), never the whole file into memory at once.
"""
from __future__ import annotations

import json
from typing import Optional

import torch

MODEL, OPTIMIZER = "model.", "optimizer.state."


def save(cm, path: str, *, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Writes `cm.state_dict()` (and `optimizer.state_dict()`) to the safetensors file `path`."""
    from safetensors.torch import save_file

    tensors, metadata = {}, {"format": "pt"}
    for key, value in cm.state_dict().items():
        tensors[MODEL + key] = _storable(value, key)
    if optimizer is not None:
        state = optimizer.state_dict()
        scalars: dict[str, dict[str, object]] = {}
        for index, entries in state["state"].items():
            for name, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{OPTIMIZER}{index}.{name}"] = _storable(value, f"optimizer state {index}.{name}")
                else:
                    scalars.setdefault(str(index), {})[name] = value
        metadata["optimizer"] = json.dumps({"param_groups": state["param_groups"], "scalars": scalars})
    save_file(tensors, path, metadata=metadata)


def load(cm, path: str, *, optimizer: Optional[torch.optim.Optimizer] = None, strict: bool = True):
    """Loads a file written by `save` into `cm` (and `optimizer`); returns load_state_dict's result."""
    from safetensors import safe_open

    model_state, optimizer_state = {}, {}
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        for key in f.keys():
            if key.startswith(MODEL):
                model_state[key[len(MODEL):]] = f.get_tensor(key)
            elif key.startswith(OPTIMIZER) and optimizer is not None:
                index, name = key[len(OPTIMIZER):].split(".", 1)
                optimizer_state.setdefault(int(index), {})[name] = f.get_tensor(key)
    result = cm.load_state_dict(model_state, strict=strict)
    if optimizer is not None:
        if "optimizer" not in metadata:
            raise ValueError(f"{path} holds no optimizer state; it was saved without optimizer=")
        saved = json.loads(metadata["optimizer"])
        for index, scalars in saved["scalars"].items():
            optimizer_state.setdefault(int(index), {}).update(scalars)
        optimizer.load_state_dict({"state": optimizer_state, "param_groups": saved["param_groups"]})
    return result


def _storable(value, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"cannot save {what}: it is a {type(value).__name__}, not a tensor; "
                        f"safetensors stores tensors only")
    return value.detach().cpu().contiguous().clone()  # clone: tied weights must not share storage
