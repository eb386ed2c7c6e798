"""GPU training benchmark: a Llama-style ~1B model, bf16, fused AdamW; one run, same model and data
for every row — eager, torch.compile, and pipeline.jit with several executor lists.

    python benchmarks/train_gpu.py                 # the full config (H200: a few minutes)
    python benchmarks/train_gpu.py --layers 2      # a quick look

Columns: tokens/s over steps 5-20, MFU = (6·params + 12·layers·seq·dim) FLOPs per token against
790 TFLOP/s (the bf16 matmul rate measured on the H200), first-step (compile) time, peak memory
(torch.cuda.max_memory_allocated), and the 20-step loss curve's max deviation from eager.
"""
import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import pipeline  # noqa: E402
from models import Llama, LlamaConfig  # noqa: E402
from models.llama import next_token_loss  # noqa: E402

PEAK_FLOPS = 790e12


class WithLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return next_token_loss(self.model(tokens), tokens)


def rows(only):
    import executors
    table = [("eager", None), ("torch.compile", "compile"),
             ("pipeline.jit [inductor]", ["inductor"]),
             ("pipeline.jit [nvfuser, inductor]", ["nvfuser", "inductor"]),
             ("pipeline.jit [te, nvfuser, inductor] bf16", ["te", "nvfuser", "inductor"])]
    fp8 = getattr(getattr(executors, "te", None), "fp8", None)
    if fp8 is not None:
        table.append(("pipeline.jit [te fp8, nvfuser, inductor]", [fp8(), "nvfuser", "inductor"]))
    return [r for r in table if not only or any(o in r[0] for o in only)]


def run_row(name, how, config, batches):
    torch.manual_seed(0)
    model = WithLoss(Llama(config)).cuda().to(torch.bfloat16)
    if how is None:
        step_fn = model
    elif how == "compile":
        step_fn = torch.compile(model)
    else:
        step_fn = pipeline.jit(model, executors=how)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for tokens in batches:
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step_fn(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() / 2**30
    extra = {}
    if how not in (None, "compile"):
        table = pipeline.regions(step_fn)
        extra["ops_by_executor"] = table.by_executor()
        extra["fp8_gemm_flop_share"] = getattr(table, "fp8_gemm_flop_share", lambda: None)()
    del model, step_fn, opt
    gc.collect()
    torch.cuda.empty_cache()
    return losses, times, peak, extra


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", nargs="*", default=[], help="substrings of row names to run")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    config = LlamaConfig.llama_1b()
    config.layers, config.max_seq = args.layers, args.seq
    params = Llama(LlamaConfig(**{**config.__dict__, "layers": 0})).num_params() + \
        args.layers * sum(p.numel() for p in Llama(LlamaConfig(**{**config.__dict__, "layers": 1})).layers.parameters())
    flops_per_token = 6 * params + 12 * config.layers * args.seq * config.dim
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, config.vocab, (args.batch, args.seq), generator=g).cuda() for _ in range(args.steps)]
    tokens_per_step = args.batch * args.seq
    print(f"Llama-style {params / 1e9:.2f}B params, {config.layers} layers, batch {args.batch} x seq {args.seq}, "
          f"bf16, fused AdamW, {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    header = f"{'':44} {'tokens/s':>9} {'MFU':>6} {'1st step s':>10} {'peak GiB':>9} {'max |Δloss|':>11}"
    print(header, flush=True)
    results, eager_losses = [], None
    for name, how in rows(args.only):
        try:
            losses, times, peak, extra = run_row(name, how, config, batches)
        except Exception as e:  # a row that cannot run says why; the others still run
            print(f"{name:44} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            results.append({"row": name, "error": f"{type(e).__name__}: {e}"[:2000]})
            gc.collect()
            torch.cuda.empty_cache()
            continue
        eager_losses = eager_losses or losses
        steady = times[4:]
        tps = tokens_per_step * len(steady) / sum(steady)
        mfu = tps * flops_per_token / PEAK_FLOPS
        dev = max(abs(a - b) for a, b in zip(losses, eager_losses))
        print(f"{name:44} {tps:9.0f} {mfu:6.1%} {times[0]:10.1f} {peak:9.2f} {dev:11.2e}", flush=True)
        if extra:
            print(f"    {extra}", flush=True)
        results.append({"row": name, "tokens_per_s": tps, "mfu": mfu, "first_step_s": times[0],
                        "peak_gib": peak, "max_loss_dev": dev, "losses": losses, **extra})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
