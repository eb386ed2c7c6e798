"""Regenerates docs/regions.svg: `pipeline.draw` of the demo's model (examples/demo.py, `make demo`)
after a few training steps, labelled with the time of a profiled step. On CPU, as the demo runs there:
Inductor compiles the forward and the backward (~30 s on 2 cores).

    .venv/bin/python scripts/draw_demo.py                                   # docs/regions.svg
    .venv/bin/python scripts/draw_demo.py --executors torch --out /tmp/regions.html
    python scripts/draw_demo.py --device cuda --executors te,nvfuser,inductor --out regions.dot   # a GPU's mix
    dot -Tsvg regions.dot -o docs/regions.svg      # where the GPU machine has no Graphviz
"""
import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import pipeline  # noqa: E402
from models import LanguageModelLoss, Llama, LlamaConfig  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--executors", default="inductor", help="comma-separated, by priority (the demo's default)")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "regions.svg"), help=".svg, .dot or .html")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-profile", action="store_true", help="no times in the boxes (a reproducible file)")
    args = parser.parse_args()

    start = time.perf_counter()
    torch.manual_seed(0)
    config = LlamaConfig(vocab=512, dim=128, layers=2, heads=4, kv_heads=2, hidden=352, max_seq=64)  # the demo's
    model = LanguageModelLoss(Llama(config)).to(args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)
    tokens = torch.randint(0, config.vocab, (8, 64), device=args.device)
    cm = pipeline.jit(model, executors=args.executors.split(","))
    for _ in range(3):  # compiled, then steady: a profile of the first steps times warm-up, not the regions
        cm(tokens).backward()
    times = None if args.no_profile else pipeline.profile(cm, tokens)
    path = pipeline.draw(cm, args.out, profile=times)
    print(pipeline.regions(cm))
    print(f"wrote {os.path.relpath(path)} ({len(pipeline.regions(cm))} regions) in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
