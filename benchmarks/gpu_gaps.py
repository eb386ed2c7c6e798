"""Where the GPU waits: idle gaps between kernels in a profiler chrome trace, and what the CPU was
doing meanwhile.

A training step whose kernels take 60 ms but whose wall time is 67 ms spent 7 ms with the GPU idle:
the CPU had not yet launched the next kernel (Python, dispatch, allocation, a synchronizing call).
For each gap this finds the next kernel's launch and attributes every microsecond of the gap to the
innermost CPU event running at that time, under the region (`region12:te`) it belongs to.

    python benchmarks/gpu_gaps.py trace.json        # a chrome trace from torch.profiler
"""
import collections
import json
import os
import sys
import tempfile

import numpy as np

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
CPU_CATS = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function"}


def idle_gaps(trace: dict, min_gap_us: float = 5.0, top: int = 12) -> list[str]:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    if not gpu:
        return ["no GPU events in the trace"]
    cpu = [e for e in events if e.get("cat") in CPU_CATS]
    starts = np.array([e["ts"] for e in cpu], dtype=np.float64)
    ends = starts + np.array([e["dur"] for e in cpu], dtype=np.float64)
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in cpu
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    regions = [e for e in cpu if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("region")]

    busy_end, busy, gaps = gpu[0]["ts"] + gpu[0]["dur"], gpu[0]["dur"], []
    for e in gpu[1:]:
        if e["ts"] > busy_end + min_gap_us:
            gaps.append((busy_end, e["ts"], e))
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], busy_end))
        busy_end = max(busy_end, e["ts"] + e["dur"])
    span = busy_end - gpu[0]["ts"]
    attribute = _attributor(cpu, starts, ends, launch_ts, regions)
    by_cause, rows = collections.Counter(), []
    for a, b, kernel in gaps:
        causes = attribute(a, b, kernel)
        by_cause.update(causes)
        rows.append((b - a, causes.most_common(1)[0][0] if causes else "?", kernel["name"]))
    # before the first kernel the GPU is idle too: the step's launch latency (Python, guards, wrappers)
    lead_b = gpu[0]["ts"]
    lead_a = float(starts.min()) if len(starts) else lead_b  # a trace without CPU events: unknown
    lead = attribute(lead_a, lead_b, gpu[0]) if lead_b > lead_a else collections.Counter()
    idle = sum(b - a for a, b, _ in gaps)
    out = [f"GPU span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, idle in {len(gaps)} gaps of >{min_gap_us:.0f} us: "
           f"{idle / 1e3:.2f} ms"]
    out.append(f"before the first kernel (from the step's first CPU event): {max(0.0, lead_b - lead_a) / 1e3:.2f} ms: "
               + ", ".join(f"{name[:60]} {us / 1e3:.2f}" for name, us in lead.most_common(4)))
    out += ["idle by what the CPU was doing:"] + [f"  {us / 1e3:6.2f} ms  {name[:120]}" for name, us in by_cause.most_common(top)]
    out += ["largest gaps:"] + [f"  {us:7.0f} us  {cause[:70]}  -> {name[:60]}" for us, cause, name in sorted(rows, reverse=True)[:top]]
    return out


def _attributor(cpu, starts, ends, launch_ts, regions):
    """A function (a, b, next_kernel) -> Counter of idle microseconds by the innermost CPU event
    running at each moment of [a, b) (or by "queued" when the next kernel was launched before a)."""
    def attribute(a, b, kernel):
        launched = launch_ts.get(kernel.get("args", {}).get("correlation"))
        if launched is not None and launched < a:  # queued before the GPU went idle: a dependency wait
            return collections.Counter({"(queued: waiting on a stream or event)": b - a})
        inside = np.nonzero((starts < b) & (ends > a))[0]
        causes = collections.Counter()
        for t in np.arange(a, b, 1.0):  # 1 us samples: the innermost CPU event at each
            live = [i for i in inside if starts[i] <= t < ends[i]]
            if not live:
                causes["(no CPU event: Python between ops)"] += 1.0
                continue
            i = min(live, key=lambda i: ends[i] - starts[i])
            causes[_label(cpu[i], regions, t)] += 1.0
        return causes
    return attribute


# kernel name patterns, first match wins: what kind of work a GPU kernel is
KERNEL_KINDS = [
    ("attention", r"cudnn|flash|fmha|attention|sdpa"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|wgmma"),
    ("optimizer", r"multi_tensor|adam"),
    ("te cast/quantize", r"transformer_engine|cast_transpose|quantize|amax|fp8"),
    ("inductor (triton)", r"^triton_"),
    ("nvfuser", r"nvfuser|^kernel[0-9]*$|CudaCodeGen"),
    ("aten reductions/index", r"reduce_kernel|index|scatter|gather|embedding|sort|radix|cub::"),
    ("aten elementwise/copy", r"elementwise|vectorized|unrolled|copy|fill|memset|memcpy"),
]


def chrome_trace(prof, path: str | None = None) -> dict:
    """A torch.profiler run as its chrome-trace dict (kept at `path` when given)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = path or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)


def kernel_kinds(trace: dict) -> list[str]:
    """GPU time of one traced step by kind of kernel (GEMM, attention, Inductor, nvFuser, TE casts,
    optimizer, ...), from the trace's kernel events, so two rows' steps compare kind by kind."""
    import re
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    by, count = collections.Counter(), collections.Counter()
    for e in events:
        kind = next((k for k, pat in KERNEL_KINDS if re.search(pat, e["name"], re.I)), "other")
        by[kind] += e["dur"]
        count[kind] += 1
    total = sum(by.values())
    return [f"kernels {total / 1e3:.2f} ms in {sum(count.values())} launches"] + [
        f"  {us / 1e3:7.2f} ms x{count[k]:<5} {k}" for k, us in by.most_common()]


def _label(event: dict, regions: list, t: float) -> str:
    inside = [r["name"] for r in regions if r["ts"] <= t < r["ts"] + r["dur"]]
    where = f"[{inside[-1].split(':', 1)[-1]} region] " if inside else ""
    return where + str(event.get("name", "?"))


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        trace = json.load(f)
    print("\n".join(kernel_kinds(trace) + idle_gaps(trace)))
