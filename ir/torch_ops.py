"""Facts about torch-level ops that passes and executors share (both import `ir`, not each other)."""
import torch

from .rewrite import Call

# The calls a captured `nn.Linear` / `F.linear` is in a torch-level trace, and the pattern of one.
LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)
LINEAR = Call(LINEARS, ("input", "weight", "bias"), input="x", weight="w", bias="b")
