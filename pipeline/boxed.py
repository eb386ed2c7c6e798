"""The boxed calling convention for compiled stages: the callee takes the argument *list* and empties
it, so each input (a saved activation in the backward, say) is freed right after its last use rather
than when the whole stage returns. AOTAutograd calls functions marked `_boxed_call` this way.
"""
from __future__ import annotations

import operator

import torch.fx as fx


def boxed(gm: fx.GraphModule):
    """A function `fn(args: list)` running `gm` that clears `args` once it has read it."""
    graph = fx.Graph()
    args_list = graph.placeholder("args_list")
    value_map: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        value_map[node] = graph.call_function(operator.getitem, (args_list, i))
        value_map[node].name = node.name
    graph.call_method("clear", (args_list,))
    out = graph.graph_copy(gm.graph, value_map)
    graph.output(out)
    runner = fx.GraphModule(gm, graph)
    fn = runner.forward

    def run(args):
        return fn(args)
    run._boxed_call = True  # AOTAutograd's marker for this convention
    return run
