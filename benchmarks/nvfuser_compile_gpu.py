"""How long nvFuser takes to compile distinct fusions one after another, and in a pool of threads:
whether the `nvfuser` executor's first-step compile time (the regions' trial runs) can overlap.

Builds 2 × N distinct fusions shaped like the training step's (a chain of SiLU-style pointwise ops
ending in an RMSNorm-style reduction, N chain lengths, two kinds of ending), through the executor's
own translation; compiles the first N in one thread and the other N in a pool.

    python benchmarks/nvfuser_compile_gpu.py [--fusions 8 --threads 8]
"""
import argparse
import concurrent.futures
import time

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from executors.nvfuser_executor import _define


def region(chain: int, ending: str):
    def f(x, w):
        y = x.float()
        for _ in range(chain):
            y = y * torch.sigmoid(y)
        if ending == "norm":
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        else:
            y = y - y.amax(-1, keepdim=True)
        return ((y * w).to(torch.bfloat16),)
    return f


def main():
    from nvfuser_direct import FusionDefinition
    p = argparse.ArgumentParser()
    p.add_argument("--fusions", type=int, default=8)
    p.add_argument("--threads", type=int, default=8)
    a = p.parse_args()
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.float32)

    def build(chain, ending):
        gm = make_fx(region(chain, ending))(x, w)
        return _define(FusionDefinition, gm, [x, w])

    def compile_and_run(fd):
        start = time.perf_counter()
        fd.execute([x, w])
        torch.cuda.synchronize()
        return time.perf_counter() - start

    print(f"nvFuser compile of {a.fusions} distinct fusions, {torch.cuda.get_device_name()}")
    for ending, threads in [("norm", 1), ("amax", a.threads)]:
        fds = [build(c + 1, ending) for c in range(a.fusions)]
        start = time.perf_counter()
        if threads == 1:
            each = [compile_and_run(fd) for fd in fds]
        else:
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                each = list(pool.map(compile_and_run, fds))
        total = time.perf_counter() - start
        print(f"  {threads} thread(s), {ending} endings: {total:6.2f} s wall, each {min(each):.2f}-{max(each):.2f} s, "
              f"sum {sum(each):6.2f} s")
        again = [compile_and_run(fd) for fd in fds]
        print(f"    second run (compiled): {1e3 * max(again):.2f} ms at most")


if __name__ == "__main__":
    main()
