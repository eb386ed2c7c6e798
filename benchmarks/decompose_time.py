"""How long Inductor's decompositions take on a training step's graphs, two ways: spliced in op by op
(`decompose_graph`, what the inductor executor does) and by re-tracing the whole graph with
`make_fx(decomposition_table=...)` (what it did before). Part of every Inductor region's compile
time, so of the first step; both give the same ops (tests/test_decompose_graph.py).

    python benchmarks/decompose_time.py                         # the GPU benchmark's 0.85B model
    python benchmarks/decompose_time.py --device cpu --dim 64   # same graphs, small tensors
"""
import argparse
import os
import sys
import time

import torch

os.environ.setdefault("PIPELINE_CACHE", "0")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import pipeline  # noqa: E402
from executors import inductor_executor as ie  # noqa: E402
from executors.base import RegionDeclined  # noqa: E402
from executors.decompose import decompose_graph  # noqa: E402
from models import LanguageModelLoss, Llama, LlamaConfig  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dim", type=int, default=2048, help="hidden size (the graphs do not depend on it)")
    p.add_argument("--repeat", type=int, default=2)
    a = p.parse_args()
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx
    table = ie._decompositions(False)
    rows = []

    def measure(gm, example_inputs):  # in place of the executor's compile: time both ways, decline
        fakes = list(example_inputs)
        with detect_fake_mode(fakes):
            for _ in range(a.repeat):
                start = time.perf_counter()
                decompose_graph(gm, table)
                by_op = time.perf_counter() - start
                start = time.perf_counter()
                make_fx(gm, decomposition_table=table, tracing_mode="real")(*fakes)
                whole = time.perf_counter() - start
                rows.append((len(gm.graph.nodes), by_op, whole))
        raise RegionDeclined("timed only")

    ie._inductor_decomposed = measure
    scale = a.dim // 64
    config = LlamaConfig(vocab=500 * scale, dim=a.dim, layers=a.layers, heads=32, kv_heads=8,
                         hidden=88 * scale, max_seq=2048)
    model = LanguageModelLoss(Llama(config), fp32_loss=True).to(a.device, torch.bfloat16)
    tokens = torch.randint(0, config.vocab, (1, 128), device=a.device)
    pipeline.jit(model, executors=["inductor"])(tokens).backward()
    print(f"{a.layers} layers, {a.device}, torch {torch.__version__}: Inductor's decompositions, seconds")
    for nodes, by_op, whole in rows:
        print(f"  graph of {nodes:5d} nodes: op by op {by_op:6.2f}   whole graph re-traced {whole:6.2f}")


if __name__ == "__main__":
    main()
