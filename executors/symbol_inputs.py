"""Every region receives the shape symbols its code names, not only the values its ops take as arguments (what
`fuse_by_partitions` gives it): a backward region padding by a saved `s48 - 10` to a size `s48` needs `s48` itself,
which only an input that is that plain symbol binds (`ir.symbols`); else Inductor's code raised `NameError`."""

import torch
import torch.fx as fx

from ir import node_value
from ir.symbols import binds, unbound_symbols


def pass_symbol_inputs(gm: fx.GraphModule) -> None:
    """Gives each region call of `gm` an input per symbol its region needs but does not bind: the earliest value before
    it binding the symbol, a SymInt rather than a tensor (kept alive longer); `check_symbols_bound` reports the rest."""
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    missing = {call: unbound_symbols(gm.get_submodule(call.target)) for call in calls}  # static: [] at once
    if not any(missing.values()):
        return
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    binders: dict[str, list[fx.Node]] = {}  # symbol -> the nodes of gm binding it, SymInts first
    for node in gm.graph.nodes:
        if node.op != "call_module":
            for s in binds(node_value(node)):
                binders.setdefault(str(s), []).append(node)
    for nodes in binders.values():
        nodes.sort(key=lambda n: (not isinstance(node_value(n), torch.SymInt), order[n]))
    for call, problems in missing.items():
        added = []
        for problem in problems:
            source = next((b for b in binders.get(problem.symbol, ()) if order[b] < order[call]), None)
            if source is not None and source not in call.args and source not in added:
                added.append(source)
        if added:
            _add_inputs(gm.get_submodule(call.target), call, added)


def _add_inputs(region: fx.GraphModule, call: fx.Node, values: list[fx.Node]) -> None:
    with region.graph.inserting_before(next(n for n in region.graph.nodes if n.op != "placeholder")):
        for value in values:  # each after the last placeholder, in order
            p = region.graph.placeholder(f"{value.name}_symbol")
            p.meta.update({k: v for k, v in value.meta.items() if k in ("val", "example_value", "tensor_meta")})
    call.args = tuple(call.args) + tuple(values)
    region.recompile()
