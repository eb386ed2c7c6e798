"""Which fusion executor is faster on each region: every region one executor ran in a training step
of the benchmark's Llama, timed again on random inputs of the same shapes, next to the same region
compiled by another executor.

    python benchmarks/region_race.py --layers 2                   # nvFuser's regions vs Inductor's
    python benchmarks/region_race.py --layers 2 --ran inductor --against nvfuser

Per region (identical regions of other layers counted once, weighted by how many there are): the GPU
time of both, how many kernels each launches, and the ops. The totals say what a step would gain if
every region ran on the faster one. CUDA events, 3 warm-up calls, median of 20.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import executors  # noqa: E402
import pipeline  # noqa: E402
from executors.compiled_region import CompiledRegion  # noqa: E402
from executors.plan import _compile_isolated  # noqa: E402
from ir import node_value  # noqa: E402
from models import LanguageModelLoss, Llama, LlamaConfig  # noqa: E402
from cuda_timing import cuda_median_ms  # noqa: E402
from gpu_gaps import chrome_trace  # noqa: E402
from pipeline.inspect import _clip, _summarize  # noqa: E402


DEVICE = "cuda"


def real_inputs(source):
    """Random tensors with the metadata of the region's inputs (integers: zeros, a valid index)."""
    out = []
    for n in source.graph.nodes:
        if n.op != "placeholder":
            continue
        v = node_value(n)
        if isinstance(v, torch.Tensor):
            t = torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=DEVICE)
            t.copy_(torch.randn(t.shape, device=DEVICE) if v.dtype.is_floating_point else torch.zeros(t.shape))
            out.append(t)
        else:
            out.append(v)
    return out


def gpu_ms(fn, args, warmup=3, reps=20):
    if DEVICE != "cpu":
        return cuda_median_ms(fn, *args, warmup=warmup, reps=reps)
    for _ in range(warmup):  # a smoke test of the script on the CPU: host time
        fn(*args)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def kernels(fn, args):
    """(name, µs) of the GPU kernels one call launches, in launch order."""
    from torch.profiler import ProfilerActivity, profile
    if DEVICE == "cpu":
        return []
    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    events = chrome_trace(prof).get("traceEvents", [])
    return [(e["name"], e["dur"]) for e in sorted(events, key=lambda e: e.get("ts", 0))
            if e.get("ph") == "X" and e.get("cat") == "kernel"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--ran", default="nvfuser", help="the executor whose regions are raced")
    p.add_argument("--against", default="inductor", help="the executor they are raced against")
    p.add_argument("--kernels", type=int, default=6, help="list the kernels of the N regions that lose most")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (e.g. --ran inductor --against torch)")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    config = LlamaConfig.llama_1b() if DEVICE == "cuda" else LlamaConfig(vocab=256, dim=64, layers=0, heads=4,
                                                                             kv_heads=2, hidden=128, max_seq=0)
    config.layers, config.max_seq = args.layers, args.seq
    torch.manual_seed(0)
    model = LanguageModelLoss(Llama(config), fp32_loss=True).to(DEVICE, torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    cm = pipeline.jit(model, executors=[args.ran, args.against])
    tokens = torch.randint(0, config.vocab, (args.batch, args.seq), device=DEVICE)
    cm(tokens).backward()

    twins = {}
    for r in pipeline.regions(cm):
        if r.compiled_as is not None:
            twins[r.compiled_as] = twins.get(r.compiled_as, 0) + 1
    other = getattr(executors, args.against)
    rows = []
    for trace in pipeline.last_traces(cm):
        for _, mod in trace.module.named_modules():
            if not isinstance(mod, CompiledRegion) or mod.region.executor != args.ran or mod.region.compiled_as is not None:
                continue
            inputs = real_inputs(mod.source)
            fakes = [node_value(n) for n in mod.source.graph.nodes if n.op == "placeholder"]
            mine = gpu_ms(mod.fn, inputs)
            try:
                theirs_fn = _compile_isolated(other, mod.source, fakes)
                other.finish_region(theirs_fn)  # its kernels compiled, not timed
                theirs = gpu_ms(theirs_fn, inputs)
            except Exception as e:  # noqa: BLE001 - the table says why
                theirs_fn, theirs = None, f"{type(e).__name__}: {str(e)[:60]}"
            rows.append((mod.region, 1 + twins.get(mod.region.id, 0), mine, theirs, mod.fn, theirs_fn, inputs))
    print(f"{'id':>4} {'stage':9} {'x':>3} {args.ran + ' ms':>12} {args.against + ' ms':>12}  ops")
    total_mine = total_theirs = total_best = 0.0
    for region, n, mine, theirs, *_ in rows:
        t = f"{theirs:12.3f}" if isinstance(theirs, float) else f"{'-':>12}"
        print(f"{region.id:4} {region.stage:9} {n:3} {mine:12.3f} {t}  {_summarize(region.ops, 110)}")
        if not isinstance(theirs, float):
            print(f"{'':32}{args.against} could not compile it: {theirs}")
            theirs = mine
        total_mine += n * mine
        total_theirs += n * theirs
        total_best += n * min(mine, theirs)
    print(f"per step: {args.ran} {total_mine:.2f} ms, {args.against} {total_theirs:.2f} ms, "
          f"the faster of the two per region {total_best:.2f} ms")
    losers = sorted((r for r in rows if isinstance(r[3], float)), key=lambda r: -(r[2] - r[3]) * r[1])
    for region, n, mine, theirs, fn, theirs_fn, inputs in losers[:args.kernels]:
        print(f"\nregion {region.id} ({region.stage}, x{n}): {mine:.3f} vs {theirs:.3f} ms; inputs "
              f"{_clip(', '.join(region.input_shapes), 200)}; outputs {_clip(', '.join(region.output_shapes), 200)}")
        for who, f in ((args.ran, fn), (args.against, theirs_fn)):
            for name, us in kernels(f, inputs):
                print(f"  {who:9} {us:8.1f} us  {name[:110]}")


if __name__ == "__main__":
    main()
