"""`materialize(checkpoint=None)`: a `meta`-device model gets real storage at jit time (docs/passes.md), from its
modules' `reset_parameters()` or a safetensors checkpoint read tensor by tensor (into every tensor, `meta` or not)."""

import warnings
from typing import Optional

import torch

from ir import PipelineWarning

from .base import pass_factory

SAVED_PREFIX = "model."  # where `pipeline.save` keeps the model's state dict


class Materialize:
    """Applied to the module before capture (see `pipeline.jit`)."""

    def __init__(self, checkpoint: Optional[str] = None, device="cpu"):
        self.checkpoint, self.device = checkpoint, torch.device(device)
        self.name = "materialize" + (f"({checkpoint!r})" if checkpoint else "()")

    def prepare_module(self, model: torch.nn.Module, skip: frozenset = frozenset()) -> None:
        """Gives every meta tensor of `model` storage and values; `skip`: keys model transforms loaded already."""
        on_meta = [(name, m) for name, m in model.named_modules() if any(t.is_meta for _, t in _own_tensors(m))]
        # Without a checkpoint every module initialises itself; with one, only those whose state it cannot hold
        needs_init = [(name, m) for name, m in on_meta
                      if self.checkpoint is None or getattr(m, "_non_persistent_buffers_set", ())]
        if missing := [name or type(m).__name__ for name, m in needs_init
                       if not callable(getattr(m, "reset_parameters", None))]:
            raise ValueError(f"materialize: modules {missing} have meta tensors but no reset_parameters() to "
                             f"initialise them; give them one" + ("" if self.checkpoint else ", or pass a checkpoint"))
        if self.checkpoint is None and on_meta and (custom := [type(m).__name__ for _, m in [("", model), *on_meta]
                                                               if hasattr(m, "_init_weights")]):
            warnings.warn(f"materialize(): {custom[0]}._init_weights ran on the meta device only; the tensors come from "
                          f"each module's reset_parameters() instead. To start from the weights eager gives, pass "
                          f"materialize(checkpoint) a file of them", PipelineWarning, stacklevel=4)
        # What reset_parameters() must set (with a checkpoint: only what the file cannot hold) starts poisoned.
        owed = [(prefix, m, name) for prefix, m in needs_init for name, t in _own_tensors(m)
                if t.is_meta and (self.checkpoint is None or name in m._non_persistent_buffers_set)]
        made: dict[int, tuple] = {}  # id(meta tensor) -> (it, its real tensor): tied weights stay tied
        for _, module in on_meta:
            _to_empty_meta_only(module, self.device, made)
        with torch.no_grad():
            owed = [(prefix, m, name, _poison(getattr(m, name))) for prefix, m, name in owed]
            for _, module in needs_init:
                module.reset_parameters()
        if unset := [f"{prefix}.{name}".lstrip(".") for prefix, m, name, mark in owed
                     if _poisoned(getattr(m, name), mark)]:
            raise ValueError(f"materialize: reset_parameters() left {_listed(unset)} unset, wholly or in part (a value "
                             f"computed in __init__ is lost on the meta device): set it in reset_parameters()")
        if self.checkpoint is not None:  # the user asked for the file's values: loaded even with nothing on meta
            load_tensors(model, self.checkpoint, skip)


def load_tensors(model: torch.nn.Module, path: str, skip: frozenset = frozenset()) -> None:
    """Copies each parameter and persistent buffer from the safetensors file, one by one; `skip`: keys read, matched."""
    from safetensors import safe_open

    everything = model.state_dict(keep_vars=True)
    state = {k: v for k, v in everything.items() if k not in skip}
    with safe_open(path, framework="pt") as f, torch.no_grad():
        keys = set(f.keys())
        if missing := [k for k in state if k not in keys and not k.endswith("_extra_state")]:
            raise KeyError(lacks_message(path, missing, keys))
        casts = []
        for key, target in state.items():
            if key in keys:
                source = f.get_slice(key)[:]
                if tuple(source.shape) != tuple(target.shape):
                    raise ValueError(f"materialize: {key} is {tuple(source.shape)} in {path}, "
                                     f"the model expects {tuple(target.shape)}")
                if source.dtype != target.dtype:
                    casts.append((key, source.dtype, target.dtype))
                target.copy_(source)
    problems = [casts_message(casts)] if casts else []
    if unmatched := sorted(keys - set(everything)):
        problems.append(f"{len(unmatched)} keys match no parameter or buffer of the model and were ignored: "
                        f"{_listed(unmatched)}{_saved_hint(keys, everything)}")
    if problems:
        warnings.warn(f"materialize: loading {path}: " + "; ".join(problems), PipelineWarning, stacklevel=2)


def casts_message(casts: list) -> str:
    """Names the (key, file dtype, model dtype) casts a load made."""
    shown = _listed([f"{key} ({stored} -> {dtype})" for key, stored, dtype in casts])
    return (f"{len(casts)} tensors are stored in another dtype than the model's and were cast: {shown} "
            f"(to keep the file's dtype, convert the model, e.g. model.to(torch.float64), before jit)")


def lacks_message(where: str, missing: list, file_keys) -> str:
    """The error for tensors of the model a checkpoint does not hold."""
    return f"materialize: {where} lacks {_listed(missing)}{_saved_hint(file_keys, missing)}"


def _saved_hint(file_keys, model_keys) -> str:
    """A hint when the file holds the model's keys under `pipeline.save`'s prefix."""
    if not any(SAVED_PREFIX + k in file_keys for k in model_keys):
        return ""
    return (f". It looks like a file written by pipeline.save (the model's state under '{SAVED_PREFIX}'): jit with "
            f"materialize() and then call pipeline.load(cm, path), or write the file with the prefix stripped")


def _listed(items: list, limit: int = 8) -> str:
    return ", ".join(items[:limit]) + (f" ... ({len(items) - limit} more)" if len(items) > limit else "")


def _own_tensors(module: torch.nn.Module) -> list:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


def _to_empty_meta_only(module: torch.nn.Module, device, made: dict) -> None:
    """Like `module.to_empty(recurse=False)`, but only for tensors still on the meta device; one shared by several
    modules (tied weights) becomes one real tensor (`made`)."""
    for name, t in (item for item in _own_tensors(module) if item[1].is_meta):
        if id(t) not in made:
            real = torch.empty_like(t, device=device)
            made[id(t)] = t, torch.nn.Parameter(real, t.requires_grad) if isinstance(t, torch.nn.Parameter) else real
        if isinstance(t, torch.nn.Parameter):
            setattr(module, name, made[id(t)][1])
        else:
            module._buffers[name] = made[id(t)][1]


def _poison(t: torch.Tensor) -> tuple:
    """Fills `t` with what no initialisation writes (NaN; an integer type's minimum), so `_poisoned` finds the
    elements it left as they were. A bool tensor has no such value: its mark is itself and its version counter."""
    if t.dtype != torch.bool:
        t.fill_(torch.nan if t.is_floating_point() or t.is_complex() else torch.iinfo(t.dtype).min)
    return t, t._version


def _poisoned(t: torch.Tensor, mark: tuple) -> bool:
    if t.dtype == torch.bool:  # nothing wrote it, nor replaced it (one written in part passes)
        return t is mark[0] and t._version == mark[1]
    if t.is_floating_point() or t.is_complex():
        return bool(t.sum().isnan()) and bool(t.isnan().any())  # one reduction unless it finds a NaN (or +inf + -inf)
    return bool((t == torch.iinfo(t.dtype).min).any())


@pass_factory
def materialize(checkpoint: Optional[str] = None, device="cpu") -> Materialize:
    """Gives a meta-device model real storage at jit time: its own init, or a safetensors checkpoint."""
    return Materialize(checkpoint, device)
