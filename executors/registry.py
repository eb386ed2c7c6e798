"""Resolves what the user passed as `executors=[...]` into executor objects."""

from typing import Sequence

from .base import Executor


def known_executors() -> dict[str, Executor]:
    from . import inductor, nvfuser, te, torch
    return {e.name: e for e in (torch, inductor, nvfuser, te)}


def resolve(executors: Sequence) -> tuple[list[Executor], list[str]]:
    """Executor objects for `executors` (objects or names), in order, without the unavailable ones, and
    a message per one left out (reported as fallbacks); raises when none is available, saying why."""
    if isinstance(executors, (str, Executor)) or not hasattr(executors, "__iter__"):
        raise TypeError(f"executors must be a list of executors or their names, got {executors!r}")
    known = known_executors()
    listed: list[Executor] = []
    for e in executors:
        if isinstance(e, str):
            if e not in known:
                raise ValueError(f"unknown executor {e!r}; known executors: {sorted(known)}")
            e = known[e]
        elif not isinstance(e, Executor):
            raise TypeError(f"executors[{len(listed)}] is {e!r}, not an executor or the name of one; "
                            f"use objects from `executors` or names like 'inductor'")
        if any(x.name == e.name for x in listed):
            raise ValueError(f"executor {e.name!r} is listed twice")
        listed.append(e)
    if not listed:
        raise ValueError("executors is empty: list at least one, e.g. executors=['torch']")
    reasons = {e.name: e.available().reason for e in listed}  # None: available
    if not (usable := [e for e in listed if reasons[e.name] is None]):
        raise RuntimeError("none of the listed executors is available here — "
                           + "; ".join(f"{name}: {why}" for name, why in reasons.items()))
    return usable, [f"executor {name!r} is not available and is skipped: {why}" for name, why in reasons.items() if why is not None]
