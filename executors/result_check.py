"""Checks an executor's result against its region's trace at its first call (all calls under `PIPELINE_DEBUG=1`)."""

import os
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from ir import Region, describe_value, node_value

from .graph_utils import donated_inputs


class ResultCheck:
    """What one region's outputs must be, and how to get a replacement when they are not."""

    def __init__(self, source: fx.GraphModule, region: Region, replace: Optional[Callable[[str], Callable]]):
        self.expected = [node_value(a) if isinstance(a, fx.Node) else a for a in list(source.graph.nodes)[-1].args[0]]
        self.region, self.replace = region, replace
        self.every_call = os.environ.get("PIPELINE_DEBUG", "") not in ("", "0")
        self.donated = donated_inputs(source)

    def hold(self, args: list) -> Optional[list]:
        """A copy of the arguments, to run it again; None with donated inputs (copies: +5 GiB, 0.85B Llama backward)."""
        return None if self.donated else list(args)

    def problem(self, out: Any) -> Optional[str]:
        who = f"{self.region.executor} returned a wrong result for region {self.region.id}"
        if not isinstance(out, (tuple, list)):
            return f"{who}: {type(out).__name__}, not a tuple of {len(self.expected)} outputs"
        if len(out) != len(self.expected):
            return f"{who}: {len(out)} outputs, its trace has {len(self.expected)}"
        for i, (want, got) in enumerate(zip(self.expected, out)):
            if why := _difference(want, got):
                return f"{who}: output {i}: {why}"
        return None

    def replacement(self, problem: str) -> Callable:
        """The region compiled by the next executor that claims it (raises if there is none)."""
        if self.replace is None:
            raise RuntimeError(problem)
        return self.replace(problem)


def _difference(want, got) -> str:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"expected {describe_value(want)}, got {type(got).__name__}"
        for what, w, g in (("dtype", want.dtype, got.dtype), ("device", want.device, got.device),
                           ("layout", want.layout, got.layout)):
            if w != g and not (what == "device" and (_same_device(w, g) or _host_scalar(want, got))):
                return f"expected {what} {w}, got {g}"
        if got.dim() != want.dim() or any(isinstance(w, int) and w != g for w, g in zip(want.shape, got.shape)):
            return f"expected shape {_sizes(want.shape)}, got {tuple(got.shape)}"
        if want.layout == torch.strided and not _strides_agree(want, got):
            return f"expected strides {_sizes(want.stride())}, got {got.stride()} (shape {tuple(got.shape)})"
        return ""
    if isinstance(want, (torch.SymInt, int)) and not isinstance(want, bool):
        ok = isinstance(got, (int, torch.SymInt)) and not isinstance(got, bool)
        if ok and isinstance(want, int) and got != want:
            return f"expected {want}, got {got}"
        return "" if ok else f"expected an int, got {type(got).__name__}"
    return f"expected None, got {type(got).__name__}" if want is None and got is not None else ""


def _same_device(want: torch.device, got: torch.device) -> bool:
    """cuda and cuda:0 name the same device when the trace leaves the index out."""
    return want.type == got.type and (want.index is None or got.index is None)


def _host_scalar(want: torch.Tensor, got: torch.Tensor) -> bool:
    """A 0-dim CPU tensor for a 0-dim device one: Inductor returns host scalars so; ops take them, as in eager."""
    return want.dim() == 0 and got.dim() == 0 and got.device.type == "cpu"


def _strides_agree(want: torch.Tensor, got: torch.Tensor) -> bool:
    """The strides the trace fixes (static, of dims over one element) are the result's; an empty one has none."""
    return got.numel() == 0 or all(w == g for size, w, g in zip(want.shape, want.stride(), got.stride())
               if isinstance(size, int) and size > 1 and isinstance(w, int))


def _sizes(values) -> tuple:
    return tuple(int(v) if isinstance(v, int) else str(v) for v in values)
