"""Milliseconds per call of a GPU function, by CUDA events after a few warm-up calls: the mean over a
run of calls (`cuda_ms`), or the median of calls timed one by one (`cuda_median_ms`)."""
import statistics

import torch


def cuda_ms(fn, iters: int = 30) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def cuda_median_ms(fn, *args, warmup: int = 3, reps: int = 20) -> float:
    for _ in range(warmup):
        fn(*args)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
