"""The main job: train a small Llama-style model with pipeline.jit, print the regions and the speed.

    make demo            (or: python examples/demo.py --executors inductor --steps 10)
"""
import argparse
import copy
import time

import torch

import pipeline
from models import LanguageModelLoss, Llama, LlamaConfig


def train(step_fn, params, batches):
    opt = torch.optim.AdamW(params, lr=3e-3)
    losses, times = [], []
    for tokens in batches:
        start = time.perf_counter()
        loss = step_fn(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, times


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--executors", default="inductor", help="comma-separated, by priority")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(vocab=512, dim=128, layers=2, heads=4, kv_heads=2, hidden=352, max_seq=args.seq)
    model = LanguageModelLoss(Llama(config))
    eager = copy.deepcopy(model)
    data = [torch.randint(0, config.vocab, (args.batch, args.seq)) for _ in range(2)]
    batches = [data[i % 2] for i in range(args.steps)]  # a small corpus, seen repeatedly: loss falls
    print(f"Llama-style model: {model.model.num_params() / 1e6:.2f}M parameters, "
          f"batch {args.batch} x seq {args.seq}, {args.steps} AdamW steps on {torch.get_num_threads()} threads")

    jitted = pipeline.jit(model, executors=args.executors.split(","))
    jit_losses, jit_times = train(jitted, jitted.parameters(), batches)
    eager_losses, eager_times = train(eager, eager.parameters(), batches)

    print("\nRegions (which executor ran which ops):")
    print(pipeline.regions(jitted))
    print("\nCompile stats:")
    print(pipeline.compile_stats(jitted))
    print("\nstep  loss(eager)  loss(jit)")
    for i, (a, b) in enumerate(zip(eager_losses, jit_losses)):
        print(f"{i:>4}  {a:11.5f}  {b:9.5f}")
    steady = slice(2, None)
    eager_ms = 1e3 * sorted(eager_times[steady])[len(eager_times[steady]) // 2]
    jit_ms = 1e3 * sorted(jit_times[steady])[len(jit_times[steady]) // 2]
    print(f"\nfirst step (compile): {jit_times[0]:.1f} s")
    print(f"median step time: eager {eager_ms:.1f} ms, pipeline.jit {jit_ms:.1f} ms "
          f"({eager_ms / jit_ms:.2f}x eager)")
    print(f"max loss difference from eager over {args.steps} steps: "
          f"{max(abs(a - b) for a, b in zip(eager_losses, jit_losses)):.2e}")


if __name__ == "__main__":
    main()
