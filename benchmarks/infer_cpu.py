"""CPU inference latency of the Llama-style model: eager, torch.compile, pipeline.jit — one run.

    python benchmarks/infer_cpu.py [--batch 4 --seq 128 --iters 30]
"""
import argparse
import statistics
import time

import torch

import pipeline
from models import Llama, LlamaConfig


def latency_ms(fn, tokens, iters):
    with torch.no_grad():
        start = time.perf_counter()
        fn(tokens)  # first call: compile
        first = time.perf_counter() - start
        for _ in range(3):
            fn(tokens)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn(tokens)
            times.append(time.perf_counter() - start)
    return first, 1e3 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab=2048, dim=256, layers=4, heads=8, kv_heads=4, hidden=704, max_seq=args.seq)
    model = Llama(config).eval()
    tokens = torch.randint(0, config.vocab, (args.batch, args.seq))
    with torch.no_grad():
        reference = model(tokens)
    rows = [
        ("eager", model),
        ("torch.compile (inductor)", torch.compile(model)),
        ("pipeline.jit [torch]", pipeline.jit(model, executors=["torch"])),
        ("pipeline.jit [inductor]", pipeline.jit(model, executors=["inductor"])),
    ]
    print(f"Llama-style {model.num_params() / 1e6:.1f}M params, batch {args.batch} x seq {args.seq}, "
          f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'':26} {'first call s':>12} {'median ms':>10} {'vs eager':>9} {'max |diff|':>11}")
    eager_ms = None
    for name, fn in rows:
        first, ms = latency_ms(fn, tokens, args.iters)
        eager_ms = eager_ms or ms
        with torch.no_grad():
            diff = (fn(tokens) - reference).abs().max().item()
        print(f"{name:26} {first:12.2f} {ms:10.2f} {eager_ms / ms:8.2f}x {diff:11.2e}")


if __name__ == "__main__":
    main()
