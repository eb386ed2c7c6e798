"""What checking passes costs: the verifier's seconds against the first training step's wall time.

    python benchmarks/verify_cost.py                    # the demo's model, then the 1B config with 2 layers
    python benchmarks/verify_cost.py --seq 128 --batch 1

Each row compiles one training step on the CPU with the `torch` executor (`--executor inductor`
as the demo runs) and reports
`compile_stats(cm).seconds["verify"]` (the structural verifier on every stage, and the re-derivation
of the nodes each pass created or changed) beside the step's wall time. With mixed precision every
node's metadata is new (autocast changes dtypes), so all of them are re-derived: the worst case.
"""
import argparse
import time

import torch

import pipeline
from models import LanguageModelLoss, Llama, LlamaConfig
from transforms import checkpoint, mixed_precision


def row(name, config, transforms, batch, seq, executor="torch"):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LanguageModelLoss(Llama(config))
    cm = pipeline.jit(model, executors=[executor], transforms=transforms, cache=False)
    tokens = torch.randint(0, config.vocab, (batch, seq))
    start = time.perf_counter()
    cm(tokens).backward()
    wall = time.perf_counter() - start
    seconds = pipeline.compile_stats(cm).seconds
    verify = seconds.get("verify", 0.0)
    nodes = sum(len(t.graph.nodes) for t in pipeline.last_traces(cm))
    print(f"{name:<44} first step {wall:7.2f} s   verify {verify:6.3f} s ({100 * verify / wall:4.1f}%)   "
          f"nodes in all traces {nodes}")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--executor", default="torch", help="torch, or inductor as the demo runs")
    args = parser.parse_args()
    demo = LlamaConfig(vocab=512, dim=128, layers=2, heads=4, kv_heads=2, hidden=352, max_seq=args.seq)
    big = LlamaConfig.llama_1b()
    big.layers, big.max_seq = 2, args.seq
    for label, config in (("demo model", demo), ("1B config, 2 layers", big)):
        row(f"{label} [{args.executor}]", config, [], args.batch, args.seq, args.executor)
        row(f"{label} [{args.executor}] + mixed_precision + checkpoint", config,
            [mixed_precision("bf16"), checkpoint("selective")], args.batch, args.seq, args.executor)


if __name__ == "__main__":
    main()
