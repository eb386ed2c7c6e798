"""The reference interpreter: runs a trace node by node with `torch.fx.Interpreter`."""

import torch.fx as fx

from .trace import Trace


def interpret(trace: Trace, *args):
    """Runs `trace` on `args` one node at a time and returns its outputs as the graph returns them."""
    return fx.Interpreter(trace.module, garbage_collect_values=True).run(*args)
