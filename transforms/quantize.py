"""`quantize("int8" | "fp8")`: weight-only quantization of linear weights, for inference, dequantized in
the trace right before use (`weight.to(f32) * scale`) for executors to fuse (docs/passes.md)."""

from typing import Optional

import torch
import torch.fx as fx

from ir import fake_like, node_value
from ir.rewrite import add_call

from .base import pass_factory
from .model_transform import ModelTransform

# dtype, largest value, and how far from it a value may land and still round to it (half a step: 1 for int8, 32 at
# e4m3's top): a loaded scale stays unless the row's largest value moved by more than that
_FORMATS = {"int8": (torch.int8, 127.0, 0.5), "fp8": (torch.float8_e4m3fn, 448.0, 16.0)}


class WeightOnlyQuantization(ModelTransform):
    extra = ("scale",)
    rowwise = True  # one scale per output channel (row)
    targets = "the floating-point weights of nn.Linear modules"

    def __init__(self, kind: str):
        if kind not in _FORMATS:
            raise ValueError(f"quantize: kind must be one of {sorted(_FORMATS)}, got {kind!r}")
        self.kind, self.name = kind, f"quantize({kind})"
        self.dtype, self.qmax, self.rounding = _FORMATS[kind]

    def applies_to(self, module, qualname, param) -> bool:
        return isinstance(module, torch.nn.Linear) and qualname.endswith("weight") and param.is_floating_point()

    def cannot_encode(self, value):
        return (f"it quantizes 2-D floating-point weights, not a {value.dim()}-D {value.dtype} tensor"
                if value.dim() != 2 or not value.is_floating_point() else None)

    def encode(self, value, like: Optional[dict[str, torch.Tensor]] = None):
        value = value.detach().float()
        scale = value.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / self.qmax
        if like is not None:  # the loaded scale stays (bit-identical round trips) unless the row's largest value moved
            old = like["scale"].to(scale)  # by more than rounding explains: edited, it gets its own scale
            scale = torch.where((scale - old).abs() * self.qmax <= old * self.rounding, old, scale)
        scaled = value / scale
        q = (scaled.round() if self.dtype is torch.int8 else scaled).clamp(-self.qmax, self.qmax).to(self.dtype)
        return {"q": q, "scale": scale.to(torch.float32)}

    def decode(self, tensors, original=None):
        return tensors["q"].to(torch.float32) * tensors["scale"]

    def rebuild(self, graph: fx.Graph, inputs, original):
        q, scale = inputs["q"], inputs["scale"]
        fake = fake_like(node_value(q), original.shape, dtype=torch.float32, device=original.device)
        value = add_call(graph, torch.mul, (add_call(graph, "to", (q, torch.float32), fake), scale), fake)
        if original.dtype == torch.float32:
            return value
        return add_call(graph, "to", (value, original.dtype), fake_like(fake, original.shape, dtype=original.dtype))


@pass_factory
def quantize(kind: str = "int8") -> WeightOnlyQuantization:
    """Weight-only quantization of every `nn.Linear` weight: "int8" or "fp8" (e4m3)."""
    return WeightOnlyQuantization(kind)
