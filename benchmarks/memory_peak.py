"""What is alive on the GPU at a step's peak, and which code allocated it: `train_gpu.py --peak-memory`.

Records the CUDA caching allocator's history (torch.cuda.memory._record_memory_history, Python stacks) over
one step, replays its alloc / free events to find the moment of the largest allocated total, and lists
the blocks alive then, grouped by where they were allocated: the innermost frame of our code (pipeline/,
executors/, models/) or of a stage's generated code, with that line's source, and the innermost torch
frame. Blocks allocated before the step (parameters, optimizer state) are one line, "before the step".
Blind inside a CUDA-graph replay (its pool was allocated at recording): run rows without CUDA graphs."""
import collections
import linecache
import re

import torch
from torch._subclasses import FakeTensor

OURS = re.compile(r"/(pipeline|executors|models|transforms)/|^<eval_with_key>")  # the last: a stage's code


def record_step(step) -> dict:
    """The allocator's snapshot after running `step()` with its history recorded."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    snapshot["allocated_before"] = before
    return snapshot


def where(frames: list) -> str:
    """Our innermost frame (with its source line when it is generated code) and torch's innermost."""
    ours = next((f for f in frames if OURS.search(f["filename"])), None)
    torch_frame = next((f for f in frames if "/torch/" in f["filename"]), None)
    parts = []
    if ours is not None:
        line = linecache.getline(ours["filename"], ours["line"]).strip()
        parts.append(f"{ours['filename'].rsplit('/', 1)[-1]}:{ours['line']} {ours['name']}"
                     + (f" `{line[:90]}`" if line and ours["filename"].startswith("<") else ""))
    if torch_frame is not None:
        parts.append(f"torch {torch_frame['filename'].split('/torch/')[-1]}:{torch_frame['line']} {torch_frame['name']}")
    return " | ".join(parts) or (frames[0]["name"] if frames else "no Python frame")


def stage_line(frames: list) -> str:
    """The line of a stage's generated code the allocation came from (which region call), or ""."""
    stage = next((f for f in frames if f["filename"].startswith("<eval_with_key>")), None)
    if stage is None or stage is next((f for f in frames if OURS.search(f["filename"])), None):
        return ""  # `where` shows it already
    line = linecache.getline(stage["filename"], stage["line"]).strip()[:80]
    return f" | stage {stage['filename'][15:]}:{stage['line']} `{line}`" if line else ""


def grouped(blocks) -> dict:
    """(size, frames) blocks by where they were allocated (`where` and `stage_line`): name -> [count, bytes, sizes]."""
    groups = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    for size, frames in blocks:
        g = groups[where(frames) + stage_line(frames)]
        g[0], g[1] = g[0] + 1, g[1] + size
        g[2][size] += 1
    return groups


def group_lines(groups: dict, top: int, indent: str = "") -> list[str]:
    """The largest `top` groups, a line each: bytes, blocks, their commonest sizes, where."""
    lines = []
    for name, (count, nbytes, sizes) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
        common = ", ".join(f"{n}x{s / 2**20:.0f}MiB" for s, n in sizes.most_common(3))
        lines.append(f"{indent}{nbytes / 2**30:6.2f} GiB {count:4d} blocks ({common})  {name}")
    return lines


def peak_breakdown(snapshot: dict, device: int = 0, top: int = 25) -> list[str]:
    """Lines: the peak's total, then the live blocks at that moment grouped by `where`, largest first."""
    base = snapshot.get("allocated_before", 0)
    live: dict[int, tuple[int, list]] = {}
    total = peak = base
    at_peak: dict[int, tuple[int, list]] = {}
    peak_frames: list = []
    requested: dict[int, int] = {}  # blocks Python freed whose memory waits on another stream's use
    at_peak_requested: dict[int, int] = {}
    streams = collections.Counter()
    for event in snapshot["device_traces"][device]:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, event.get("frames", []))
            streams[event.get("stream", 0)] += 1
            total += size
        elif action == "free_requested":
            requested[addr] = size
            continue
        elif action == "free_completed":
            live.pop(addr, None)  # a block from before the step still counts in `base`
            requested.pop(addr, None)
            total -= size
        else:
            continue
        if total > peak:
            peak, at_peak, at_peak_requested, peak_frames = total, dict(live), dict(requested), event.get("frames", [])
    during = sum(size for size, _ in at_peak.values())
    lines = [f"peak {peak / 2**30:.2f} GiB: {(peak - during) / 2**30:.2f} GiB from before the step "
             f"(parameters, optimizer state, anything kept), {during / 2**30:.2f} GiB allocated during it "
             f"in {len(at_peak)} blocks",
             f"of which {sum(at_peak_requested.values()) / 2**30:.2f} GiB in {len(at_peak_requested)} blocks already freed "
             f"and waiting on a stream that used them (record_stream); allocations by stream: {dict(streams)}",
             f"the allocation that reached the peak: {where(peak_frames) + stage_line(peak_frames)}"]
    return lines + group_lines(grouped(at_peak.values()), top)


def held_at_backward_start(forward, backward, kept=()) -> list[str]:
    """What is allocated when the backward starts, what of it a garbage collection or waiting for the GPU frees
    (memory held by reference cycles, or by frees deferred on a stream), the blocks the forward allocated that
    are alive then but not saved for the backward, by the code that allocated them, and the CUDA tensors Python
    objects hold then, other than `kept` (parameters, optimizer state), by shape and by what refers to them."""
    import gc
    saved = set()

    def pack(t):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            saved.add(t.untyped_storage().data_ptr())
        return t
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    at_start = torch.cuda.memory_allocated()
    gc.collect()
    after_gc = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # the allocator handles finished streams' events when it next allocates
    after_sync = torch.cuda.memory_allocated()
    skip = {t.untyped_storage().data_ptr() for t in kept}
    not_listed, blocks = saved | skip, []
    for segment in snapshot["segments"]:
        address = segment["address"]
        for block in segment["blocks"]:
            frames, address = block.get("frames") or [], address + block["size"]
            if block["state"] == "active_allocated" and frames and address - block["size"] not in not_listed:
                blocks.append((block["size"], frames))
    unsaved = grouped(blocks)
    held = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    objects = gc.get_objects()
    for obj in objects:
        if not isinstance(obj, torch.Tensor) or not obj.is_cuda or isinstance(obj, FakeTensor):
            continue  # a fake tensor (a compiled graph's metadata) has no memory
        if obj.untyped_storage().data_ptr() not in skip:
            g = held[str(obj.dtype).replace("torch.", ""), tuple(obj.shape)]
            g[0] += 1
            g[1] += obj.untyped_storage().nbytes()
            if g[0] <= 3:
                g[2].update(type(r).__name__ for r in gc.get_referrers(obj) if r is not objects)
    backward(loss)
    lines = [f"at the backward's start {at_start / 2**30:.2f} GiB allocated; a garbage collection frees "
             f"{(at_start - after_gc) / 2**30:.2f} GiB, waiting for the GPU {(after_gc - after_sync) / 2**30:.2f} GiB more; "
             f"the forward's blocks alive then but not saved for the backward: "
             f"{sum(n for _, n, _ in unsaved.values()) / 2**30:.2f} GiB (saved: {len(saved)} storages)"]
    lines += group_lines(unsaved, 12, indent="  ")
    lines.append(f"CUDA tensors Python holds then (not parameters or optimizer state): "
                 f"{sum(n for _, n, _ in held.values()) / 2**30:.2f} GiB")
    for (dtype, shape), (count, nbytes, referrers) in sorted(held.items(), key=lambda kv: -kv[1][1])[:12]:
        lines.append(f"  {nbytes / 2**30:6.2f} GiB {count:4d} x {dtype} {list(shape)}, held by {dict(referrers.most_common(4))}")
    return lines
