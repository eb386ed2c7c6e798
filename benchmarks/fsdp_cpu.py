"""FSDP on the CPU (gloo): per-rank parameter memory and training step time, 1 process vs 1 and 2
fsdp ranks, the same global batch (each rank takes its share) — one run.

    python benchmarks/fsdp_cpu.py [--batch 8 --seq 128 --steps 10] [--device cuda]  (cuda: NCCL, a GPU per rank)

Memory is counted from tensor sizes on each rank: the parameters it holds (shards under fsdp), their
gradients, AdamW's state, and the most full-size parameter bytes gathered at once in the forward
(liveness over the lowered forward trace). Threads are split evenly between ranks.
"""
import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pipeline
from models import Llama, LlamaConfig
from models.llama import next_token_loss

CONFIG = dict(vocab=2048, dim=256, layers=4, heads=8, kv_heads=4, hidden=704)
MB = 2 ** 20


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def gathered_at_once(cm) -> int:
    """Peak bytes of gathered (full-size) parameters alive together in the lowered forward."""
    trace = next((t for t in pipeline.last_traces(cm)
                  if t.name == "g0_forward" and t.provenance[-1].name == "lower (forward)"), None)
    if trace is None:
        return 0
    nodes = list(trace.graph.nodes)
    root, last = {}, {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            if a in root:
                last[root[a]] = i
        target = str(n.target)
        if "all_gather_into_tensor" in target:
            root[n] = n
        elif n.all_input_nodes and n.all_input_nodes[0] in root and (
                "wait_tensor" in target or getattr(n.target, "is_view", False)):
            root[n] = root[n.all_input_nodes[0]]  # the same storage
    live = peak = 0
    ends = {}
    for g, end in last.items():
        ends.setdefault(end, []).append(g)
    for i, n in enumerate(nodes):
        if root.get(n) is n:
            val = n.meta["val"]
            live += val.numel() * val.element_size()
            peak = max(peak, live)
        for g in ends.get(i, []):
            live -= g.meta["val"].numel() * g.meta["val"].element_size()
    return peak


def measure(rank, world, use_fsdp, args, out):
    torch.set_num_threads(max(1, args.threads // world))
    torch.manual_seed(0)
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = Llama(LlamaConfig(**CONFIG, max_seq=args.seq)).to(device)
    if use_fsdp:
        from transforms import fsdp
        cm = pipeline.jit(model, executors=[args.executor], transforms=[fsdp()])
    else:
        cm = pipeline.jit(model, executors=[args.executor])
    opt = torch.optim.AdamW(cm.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG["vocab"], (args.batch, args.seq), generator=g).chunk(world)[rank].to(device)
    times = []
    for step in range(args.warmup + args.steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        next_token_loss(cm(tokens), tokens).backward()
        if step == 0:
            grads = nbytes(p.grad for p in cm.parameters())
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    state = nbytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    result = {"params": nbytes(cm.parameters()), "grads": grads, "optimizer": state,
              "gathered": gathered_at_once(cm), "first": times[0],
              "step": statistics.median(times[args.warmup:]), "full": model.num_params()}
    torch.save(result, os.path.join(out, f"{world}-{use_fsdp}-{rank}.pt"))


def rank_main(rank, world, use_fsdp, port, args, out):
    """One rank, in a fresh process (every row alike)."""
    if use_fsdp:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world)
    measure(rank, world, use_fsdp, args, out)
    if use_fsdp:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--executor", default="torch")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL, one GPU per rank")
    args = parser.parse_args()
    rows = [("1 process, no fsdp", 1, False), ("fsdp, 1 rank", 1, True), ("fsdp, 2 ranks", 2, True)]
    with tempfile.TemporaryDirectory() as out:
        for _, world, use_fsdp in rows:
            mp.spawn(rank_main, args=(world, use_fsdp, free_port(), args, out), nprocs=world)
        results = {(w, f): torch.load(os.path.join(out, f"{w}-{f}-0.pt")) for _, w, f in rows}
    full = results[(1, False)]["full"]
    print(f"Llama-style {full / 1e6:.1f}M params, global batch {args.batch} x seq {args.seq}, AdamW, "
          f"{'CUDA nccl' if args.device == 'cuda' else 'CPU gloo'}, {args.threads} threads split over the ranks, executor {args.executor}, torch {torch.__version__}")
    print("| row | params MiB | grads MiB | AdamW state MiB | gathered at once MiB | per-rank total MiB "
          "| first step s | step ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name, world, use_fsdp in rows:
        r = results[(world, use_fsdp)]
        total = r["params"] + r["grads"] + r["optimizer"] + r["gathered"]
        print(f"| {name} | {r['params'] / MB:.2f} | {r['grads'] / MB:.2f} | {r['optimizer'] / MB:.2f} | "
              f"{r['gathered'] / MB:.2f} | {total / MB:.2f} | {r['first']:.1f} | {1e3 * r['step']:.1f} |")


if __name__ == "__main__":
    main()
