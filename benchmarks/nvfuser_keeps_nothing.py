"""Whether nvFuser, or the pipeline's nvFuser executor, keeps a fusion's outputs or inputs alive after it ran (GPU).

    source .device/setup.sh && python3 benchmarks/nvfuser_keeps_nothing.py

Prints the CUDA memory a call adds while its outputs are held and after they are deleted (0: nothing kept), for
`FusionDefinition.execute` itself, a jitted function through [torch], [nvfuser] and [inductor], and a training step's
forward through each (what the forward leaves for the backward: [nvfuser]'s the same as [inductor]'s when it keeps
nothing extra; [torch] fuses nothing and saves more).
Asked by the `[nvfuser]` peak (docs/performance.md): on an H100 (2026-12-07, this code as a one-off experiment)
nothing was kept."""
import gc
import sys
import os

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pipeline  # noqa: E402

GiB = 2**30


def allocated() -> float:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / GiB


def direct(x: torch.Tensor) -> None:
    from nvfuser_direct import DataType, FusionDefinition
    with FusionDefinition() as fd:
        t0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
        t1 = fd.ops.mul(t0, t0)
        fd.add_output(fd.ops.cast(t1, DataType.BFloat16))
        fd.add_output(fd.ops.cast(fd.ops.sin(t1), DataType.BFloat16))
    base = allocated()
    for i in range(3):
        outs = fd.execute([x])
        held = allocated()
        del outs
        gc.collect()
        print(f"FusionDefinition.execute {i}: +{held - base:.3f} GiB with its outputs, +{allocated() - base:.3f} after")


class TwoLayers(torch.nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = torch.nn.Parameter(w)

    def forward(self, x):
        return (((x[:, :4096] * 2).relu() @ self.w).sin() * 3 @ self.w).cos().float().sum()


def main():
    x = torch.randn(8192, 16384, device="cuda", dtype=torch.bfloat16)  # 0.25 GiB
    direct(x)
    w = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    for executors in (["torch"], ["nvfuser"], ["inductor"]):
        f = pipeline.jit(lambda x, w: ((x * 2 + 1).relu() @ w).sin() * 3, executors=executors)
        with torch.no_grad():
            f(x, w)
            gc.collect()
            base = allocated()
            out = f(x, w)
            held = allocated()
            del out
            gc.collect()
        print(f"{executors}: a call +{held - base:.3f} GiB with its 0.25 GiB output, +{allocated() - base:.3f} after")
    for executors in (["torch"], ["nvfuser"], ["inductor"]):
        cm = pipeline.jit(TwoLayers(w[:4096, :4096].clone()), executors=executors)
        cm(x).backward()
        gc.collect()
        base = allocated()
        loss = cm(x)
        print(f"{executors}: a training step's forward leaves +{allocated() - base:.3f} GiB for the backward")
        loss.backward()


if __name__ == "__main__":
    main()
