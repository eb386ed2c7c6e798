"""How long nvFuser takes to compile distinct fusions one after another, and in a pool of threads:
whether the `nvfuser` executor's first-step compile time (the regions' trial runs) can overlap.

Builds 2 × N distinct fusions shaped like the training step's (a chain of SiLU-style pointwise ops
ending in an RMSNorm-style reduction, 2N chain lengths), through the executor's own translation;
after one warm-up fusion, compiles N in one thread and the other N in a pool.

Measured on the H200 (nvFuser 0.2.36, torch 2.11, 2026-12-01): 8 fusions in one thread took 6.7 s
(0.41-1.44 s each); a pool of 8 threads had not finished its 8 in the ~85 s left of the run's 100 s
limit. Compiling the regions' fusions in threads does not pay, so the executor compiles them one
after another.

    python benchmarks/nvfuser_compile_gpu.py [--fusions 8 --threads 8 --timeout 120]
"""
import argparse
import concurrent.futures
import os
import sys
import time

import torch
from torch.fx.experimental.proxy_tensor import make_fx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from executors.nvfuser_executor import _define  # noqa: E402


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
    p.add_argument("--timeout", type=float, default=120, help="seconds the pool may take before it is reported stuck")
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
    compile_and_run(build(1, "amax"))  # nvFuser's one-time setup, paid before either arm
    # the same kind of fusion in both arms (chains 2..N+1 in one thread, N+2..2N+1 in the pool)
    for first, threads in [(2, 1), (a.fusions + 2, a.threads)]:
        fds = [build(c, "norm") for c in range(first, first + a.fusions)]
        start = time.perf_counter()
        if threads == 1:
            each = [compile_and_run(fd) for fd in fds]
        else:  # a pool that hangs (nvFuser's compile holding a lock) is reported, not waited for
            pool = concurrent.futures.ThreadPoolExecutor(threads)
            futures = [pool.submit(compile_and_run, fd) for fd in fds]
            done, pending = concurrent.futures.wait(futures, timeout=a.timeout)
            if pending:
                print(f"  {threads} threads: {len(pending)} of {len(fds)} compiles unfinished after {a.timeout:.0f} s",
                      flush=True)
                os._exit(1)  # the stuck threads cannot be joined
            each = [f.result() for f in futures]
        total = time.perf_counter() - start
        print(f"  {threads} thread(s), chains {first}-{first + a.fusions - 1}: {total:6.2f} s wall, each {min(each):.2f}-{max(each):.2f} s, "
              f"sum {sum(each):6.2f} s")
        again = [compile_and_run(fd) for fd in fds]
        print(f"    second run (compiled): {1e3 * max(again):.2f} ms at most")


if __name__ == "__main__":
    main()
