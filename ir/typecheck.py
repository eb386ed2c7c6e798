"""Type checking of traces, as JAX's `check_jaxpr`: each node's value re-derived with fake tensors and compared with
the trace's claim, a pass's outputs with its input trace's (docs/passes.md); after a pass, only the nodes it changed."""

from typing import Any, Optional

import torch
import torch.fx as fx

from .trace import Trace, node_value
from .torch_ops import MODE_CHANGES as _STATEFUL  # always run, so re-derived nodes see the mode
from .verify import TraceError



def check_types(trace: Trace, *, before: Optional[Trace] = None, pass_name: str = "",
                output_dtypes_may_change: bool = False) -> None:
    """Raises `TraceError` naming the node, its neighbours and what differs when a node's metadata is not what its op
    computes. With `before` (the trace a pass was given) only nodes new or changed since are re-derived, and the outputs
    must keep `before`'s count, shapes and dtypes (unless `output_dtypes_may_change`: mixed precision)."""
    who = f"pass {pass_name!r}" if pass_name else f"trace {trace.name!r}"
    if before is not None:
        _check_outputs(before, trace, who, output_dtypes_may_change)
    known = {_key(n) for n in before.graph.nodes} if before is not None else set()
    entered: list = []  # autocast regions the trace opened, closed again however the check ends
    try:
        with torch.set_grad_enabled(torch.is_grad_enabled()):  # restores grad mode after the check
            _check_nodes(trace, known, who, entered)
    finally:
        for ctx in reversed(entered):
            torch.amp.autocast_mode._exit_autocast(ctx)


def _check_nodes(trace: Trace, known: set, who: str, entered: list) -> None:
    env: dict[fx.Node, Any] = {}
    for node in trace.graph.nodes:
        claimed = env[node] = node_value(node)  # what later nodes are checked against
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if node.target in _STATEFUL:
            env[node] = _run(node, env)
            if node.target is torch.amp.autocast_mode._enter_autocast:
                entered.append(env[node])
            elif node.target is torch.amp.autocast_mode._exit_autocast and node.args[0] in env:
                entered.remove(env[node.args[0]]) if env[node.args[0]] in entered else None
            continue
        if _key(node) in known or not _derivable(node, claimed):
            continue
        try:
            derived = _run(node, env)
        except _CannotRun:
            derived = claimed
        except Exception as e:
            raise TraceError(f"{who}: node {node.name!r} cannot be computed from its inputs: "
                             f"{type(e).__name__}: {str(e).strip()[:300]}\n{_context(node)}") from e
        if problem := _difference(claimed, derived):
            raise TraceError(f"{who}: node {node.name!r} claims {problem}\n{_context(node)}")


def _check_outputs(before: Trace, after: Trace, who: str, dtypes_may_change: bool) -> None:
    old, new = before.output_values(), after.output_values()
    if len(old) != len(new):
        raise TraceError(f"{who}: trace {after.name!r} has {len(new)} outputs, its input trace had {len(old)}; "
                         f"a pass must keep every output (AOTAutograd and the caller read them by position)")
    for i, (a, b) in enumerate(zip(old, new)):
        va, vb = (node_value(x) if isinstance(x, fx.Node) else x for x in (a, b))
        if not isinstance(va, torch.Tensor):
            continue
        if not isinstance(vb, torch.Tensor):
            raise TraceError(f"{who}: output {i} was a tensor and is now {type(vb).__name__}")
        if not _same_shape(va.shape, vb.shape):
            raise TraceError(f"{who}: output {i} changed shape from {tuple(va.shape)} to "
                             f"{tuple(vb.shape)} (node {getattr(b, 'name', b)!r})")
        if va.dtype != vb.dtype and not dtypes_may_change:
            raise TraceError(f"{who}: output {i} changed dtype from {va.dtype} to {vb.dtype} (node "
                             f"{getattr(b, 'name', b)!r}); a pass that changes output dtypes on "
                             f"purpose declares it: TracePass(..., output_dtypes_may_change=True)")


def structure(trace: Trace) -> int:
    """A hash of every node's `_key`: changes if a pass edits the trace it was given (cheaper than printing it)."""
    return hash(tuple(_key(n) for n in trace.graph.nodes))


def _key(node: fx.Node):
    """What a node is, its metadata and its inputs' by identity: a node with the same key in the pass's input trace was
    checked already (`Trace.editable` shares fake values, never copies them, so the same identity is unchanged)."""
    args = fx.node.map_arg((node.args, node.kwargs), lambda n: ("%", n.name, id(node_value(n))))
    try:
        hash(args)
    except TypeError:
        args = repr(args)
    return node.name, node.op, node.target, args, id(node_value(node)), str(node.meta.get("recompute"))


def refresh_values(changed: list[fx.Node]) -> None:
    """Sets `meta["val"]` again downstream of `changed` where an op now computes another value (its inputs changed)."""
    if not changed:
        return
    dirty = set(changed)
    env: dict[fx.Node, Any] = {}
    for node in changed[0].graph.nodes:
        env[node] = node_value(node)
        if (node in dirty or node.op not in ("call_function", "call_method")
                or not any(a in dirty for a in node.all_input_nodes) or not _derivable(node, env[node])):
            continue
        try:
            derived = _run(node, env)
        except Exception:  # left for the check to report
            continue
        if _difference(env[node], derived):
            node.meta["val"] = env[node] = derived
            if "example_value" in node.meta:
                node.meta["example_value"] = derived
            dirty.add(node)


def _derivable(node: fx.Node, claimed) -> bool:
    """Ops re-run on fake values: not higher-order ops (bodies are submodules), in-place ops (a rerun would change the
    fake input shared with another node), submodule calls, or data-dependent sizes (each run makes new symbols)."""
    target, op = node.target, node.op
    if (op not in ("call_function", "call_method") or isinstance(target, torch._ops.HigherOrderOperator)
            or (isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable)
            or (op == "call_method" and str(target).endswith("_"))
            or (op == "call_function" and isinstance(target, str))):
        return False
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    try:
        return not free_unbacked_symbols(claimed)
    except Exception:
        return True


class _CannotRun(Exception):
    """The node's inputs cannot be brought into one fake mode (symbolic sizes of two shape envs): not re-derived."""


def _run(node: fx.Node, env: dict):
    """The node's op on its inputs' fake values, in their fake mode. Captured graphs may hold fake values of several
    modes (Dynamo's, the parameters' own) and real constants: those are re-made in the first fake input's mode."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_leaves, tree_map
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
    mode = next((t.fake_mode for t in tree_leaves((args, kwargs)) if isinstance(t, FakeTensor)), None)

    def into_mode(t):
        if not isinstance(t, torch.Tensor) or mode is None or getattr(t, "fake_mode", None) is mode:
            return t
        if not isinstance(t, FakeTensor):
            return mode.from_tensor(t, static_shapes=True)
        if not all(isinstance(x, int) for x in (*t.shape, *t.stride())):
            raise _CannotRun()
        with mode:
            return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=t.device)

    args, kwargs = tree_map(into_mode, (args, kwargs))
    if kwargs.get("pin_memory"):  # pinned host memory: fake tensors cannot make it, and it changes no
        kwargs = {**kwargs, "pin_memory": False}  # shape, dtype, device or stride compared here
    with mode if mode is not None else contextlib.nullcontext():
        if node.op == "call_method":
            self_arg, *rest = args
            return getattr(self_arg, node.target)(*rest, **kwargs)
        return node.target(*args, **kwargs)


def _difference(claimed, derived) -> str:
    """'' when `claimed` describes `derived`, else what differs."""
    if isinstance(claimed, (tuple, list)) and isinstance(derived, (tuple, list)):
        if len(claimed) != len(derived):
            return f"{len(claimed)} values but its op returns {len(derived)}"
        for i, (c, d) in enumerate(zip(claimed, derived)):
            if problem := _difference(c, d):
                return f"[{i}] {problem}"
        return ""
    if isinstance(claimed, torch.Tensor) != isinstance(derived, torch.Tensor):
        if claimed is None:
            return ""  # no metadata claimed (the structural verifier reports values others use)
        return f"a {type(claimed).__name__} but its op returns a {type(derived).__name__}"
    if not isinstance(claimed, torch.Tensor):
        return ""
    for what, c, d in (("dtype", claimed.dtype, derived.dtype), ("device", claimed.device, derived.device),
                       ("layout", claimed.layout, derived.layout)):
        if c != d:
            return f"{what} {c} but its op computes {d}"
    if not _same_shape(claimed.shape, derived.shape):
        return f"shape {tuple(claimed.shape)} but its op computes {tuple(derived.shape)}"
    if claimed.layout == torch.strided and not _same_strides(claimed, derived):
        return f"strides {tuple(claimed.stride())} but its op computes {tuple(derived.stride())}"
    return ""


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(_same_size(x, y) for x, y in zip(a, b))


def _same_size(x, y) -> bool:
    """Equal sizes, symbolic ones compared without adding guards."""
    if isinstance(x, int) and isinstance(y, int):
        return x == y
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    try:
        return bool(statically_known_true(x == y)) or str(x) == str(y)
    except Exception:
        return str(x) == str(y)


def _same_strides(claimed: torch.Tensor, derived: torch.Tensor) -> bool:
    """Strides agree in every dim of more than one element (a size-1 dim's stride is arbitrary)."""
    return all((isinstance(size, int) and size <= 1) or _same_size(c, d)
               for size, c, d in zip(claimed.shape, claimed.stride(), derived.stride()))


def _context(node: fx.Node, around: int = 3) -> str:
    """The node and a few nodes either side, as fx prints them."""
    nodes = list(node.graph.nodes)
    i = nodes.index(node)
    shown = nodes[max(0, i - around): i + around + 1]
    return "\n".join(f"  {'>>' if n is node else '  '} {n.format_node()}" for n in shown)

