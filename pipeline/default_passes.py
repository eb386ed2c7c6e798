"""The passes the pipeline adds to the user's: ordinary trace passes, listed, removable by name.

    print(pipeline.default_passes())                           # what runs besides yours
    pipeline.jit(model, transforms=[mixed_precision("bf16"), pipeline.without("grouped_kv_attention")])

Each runs after the user's passes of its stage (`save_policy` just before the partitioner); one that raises is
skipped, the reason in `compile_stats` (`TracePass.optional`)."""

import dataclasses

from ir import Trace
from transforms import TracePass, causal_attention, grouped_kv_attention, shift_labels

from .save_policy import recompute_fp8_casts, recompute_upcasts


def save_policy(trace: Trace) -> Trace:
    """On the joint graph: no fp32 value computed from one upcast half-precision value, and no fp8
    cast, is saved for the backward (`save_policy.py`); the trace itself when nothing is tagged."""
    gm = trace.editable()
    forward_outputs = sum(spec.kind == "forward_output" for spec in trace.outputs)
    if recompute_upcasts(gm, forward_outputs) + recompute_fp8_casts(gm, forward_outputs) == 0:
        return trace
    gm.recompile()
    return trace.derive(gm, by="save_policy")


def default_passes() -> list[TracePass]:
    """The pipeline's own passes, in the order they run."""
    return [*(dataclasses.replace(p(), optional=True) for p in (causal_attention, grouped_kv_attention, shift_labels)),
            TracePass(save_policy, runs_on="joint", name="save_policy", optional=True)]


@dataclasses.dataclass(frozen=True)
class Without:
    """`without(name, ...)` in `transforms=[...]`: those default passes do not run."""
    names: tuple[str, ...]


def without(*names: str) -> Without:
    known = {p.name for p in default_passes()}
    if (unknown := [n for n in names if n not in known]) or not names:
        raise ValueError(f"without: no default pass named {unknown or '(none given)'}; the default passes "
                         f"are {sorted(known)}")
    return Without(tuple(names))


def with_defaults(passes: list[TracePass], removed: set[str]) -> list[TracePass]:
    return list(passes) + [p for p in default_passes() if p.name not in removed]
