"""Facts about torch-level ops that passes and executors share (both import `ir`, not each other)."""
import torch

# The calls a captured `nn.Linear` / `F.linear` is in a torch-level trace.
LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)
