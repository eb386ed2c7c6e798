"""The boxed calling convention for compiled stages (AOTAutograd's `_boxed_call`): the callee takes the
argument *list* and empties it, so each input is freed right after its last use, not when the stage returns."""

import builtins
import operator
import types
from typing import Optional

import torch.fx as fx
from torch.fx.graph import _custom_builtins
from torch.fx.graph_module import _forward_from_src

_FX_GLOBALS = {name: b.obj for name, b in _custom_builtins.items()}  # what FX's generated code may name


def boxed(gm: fx.GraphModule, stored: Optional[tuple] = None):
    """A function `fn(args: list)` running `gm` that clears `args` once it has read it. Its code is kept in
    `gm.meta["boxed_code"]`; `stored`, that of a graph of the same nodes before (a warm start), is used as is."""
    if (single := _single_region(gm)) is not None:
        return single
    shape = tuple((n.op, n.name, n.target if n.op in ("call_module", "get_attr") else None) for n in gm.graph.nodes)
    if stored is not None and stored[0] == shape:
        src, names = stored[1], _FX_GLOBALS
    else:
        graph = fx.Graph()
        args_list = graph.placeholder("args_list")
        value_map: dict[fx.Node, fx.Node] = {}
        for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
            value_map[node] = graph.call_function(operator.getitem, (args_list, i))
            value_map[node].name = node.name
        graph.call_method("clear", (args_list,))
        graph.output(graph.graph_copy(gm.graph, value_map))
        _region_calls_boxed(gm, graph)
        src, names = (code := graph.python_code(root_module="self")).src, code.globals
    fn = types.MethodType(_forward_from_src(src, names), gm)  # `self.<region>`: gm's own submodules
    if all(_FX_GLOBALS.get(k, getattr(builtins, k, None)) is v for k, v in names.items()):
        gm.meta["boxed_code"] = (shape, src)  # names nothing but builtins: it can be stored

    def run(args):
        return fn(args)
    run._boxed_call = True  # AOTAutograd's marker for this convention
    return run


def _region_calls_boxed(gm: fx.GraphModule, graph: fx.Graph) -> None:
    """Each region call `region(a, b)` becomes `region.call_boxed(list((a, b)))`: the generated code drops its
    references at the packing, so a region emptying the list frees each input after its last use, not at its return."""
    for node in list(graph.nodes):
        if node.op != "call_module" or node.kwargs or not hasattr(gm.get_submodule(node.target), "call_boxed"):
            continue
        with graph.inserting_before(node):
            packed = graph.call_function(list, (tuple(node.args),))
            call = graph.call_method("call_boxed", (graph.get_attr(node.target), packed))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)


def _single_region(gm: fx.GraphModule):
    """For a stage that is one region call (placeholders -> the call -> its outputs), a runner handing the argument
    list straight to it: no frame of ours holds the inputs while it runs (as under torch.compile). Else None."""
    nodes = list(gm.graph.nodes)
    calls = [n for n in nodes if n.op == "call_module"]
    rest = [n for n in nodes if n.op not in ("placeholder", "call_module", "output")]
    if len(calls) != 1 or any(n.target is not operator.getitem or n.args[0] is not calls[0] for n in rest):
        return None
    if not hasattr(region := gm.get_submodule(calls[0].target), "call_boxed") or calls[0].kwargs:
        return None
    position = {n: i for i, n in enumerate(n for n in nodes if n.op == "placeholder")}

    def source(a):  # ("input", index) | ("output", index) | ("constant", value)
        if isinstance(a, fx.Node):
            if a in position:
                return ("input", position[a])
            return ("output", a.args[1]) if a.op == "call_function" else None
        return ("constant", a)

    ins = [source(a) for a in calls[0].args]
    if not isinstance(out_node := nodes[-1].args[0], (tuple, list)):
        return None
    outs = [source(a) for a in out_node]
    if any(s is None or s[0] == "output" for s in ins) or any(s is None for s in outs):
        return None
    kept = [s[1] for s in outs if s[0] == "input"]  # inputs that are also outputs

    def run(args):
        region_args = [args[i] if kind == "input" else i for kind, i in ins]
        passed = {i: args[i] for i in kept}
        args.clear()
        results = region.call_boxed(region_args)
        return tuple(results[i] if kind == "output" else passed[i] if kind == "input" else i for kind, i in outs)
    run._boxed_call = True
    return run
