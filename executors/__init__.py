"""Executors: the `Executor` protocol, the dispatcher, and the executors themselves. `from executors import te, nvfuser,
inductor, torch` gives executor objects (their modules are named `*_executor`, so a submodule never shadows these)."""
from .base import Executor, RegionDeclined
from .torch_executor import torch_executor as torch
from .inductor_executor import inductor_executor as inductor
from .nvfuser_executor import nvfuser_executor as nvfuser
from .te_executor import te_executor as te
from .compiled_region import CompiledRegion
from .plan import Execution, dispatch
from .registry import known_executors, resolve

__all__ = ["Executor", "RegionDeclined", "torch", "inductor", "nvfuser", "te", "dispatch", "Execution", "CompiledRegion", "resolve",
           "known_executors"]
