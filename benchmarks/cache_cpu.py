"""Cold vs warm first training step of the demo model through the compiled-artifact cache (CPU).

    python benchmarks/cache_cpu.py [--steps 3] [--executors inductor]

Runs the demo's Llama-style training (examples/demo.py: same model, data and AdamW) in two fresh
processes sharing one empty `PIPELINE_CACHE_DIR`: the cold one compiles and fills the cache, the
warm one finds it. Each gets its own empty `TORCHINDUCTOR_CACHE_DIR`, so the warm speed-up is ours,
not Inductor's. Prints both first-step times, their ratio, and whether the losses are identical.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(executors: list[str], steps: int) -> dict:
    """One process's training run: first-step time, losses, cache status per graph."""
    import torch

    import pipeline
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from demo import LanguageModelLoss, train
    from models import Llama, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab=512, dim=128, layers=2, heads=4, kv_heads=2, hidden=352, max_seq=64)
    model = LanguageModelLoss(Llama(config))
    data = [torch.randint(0, config.vocab, (8, 64)) for _ in range(2)]
    jitted = pipeline.jit(model, executors=executors)
    losses, times = train(jitted, jitted.parameters(), [data[i % 2] for i in range(steps)])
    stats = pipeline.compile_stats(jitted)
    return {"first_step": times[0], "losses": [float(x).hex() for x in losses],
            "cache": stats.cache, "seconds": stats.seconds}


def run(env: dict, executors: str, steps: int) -> dict:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--worker", "--executors", executors, "--steps", str(steps)],
                         env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process"] = time.perf_counter() - start
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--executors", default="inductor")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.executors.split(","), args.steps)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PIPELINE_CACHE_DIR": os.path.join(tmp, "pipeline"), "PIPELINE_CACHE": "1"}
        results = {}
        for name in ("cold", "warm"):
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, f"inductor-{name}")  # fresh, empty
            results[name] = run(env, args.executors, args.steps)
    cold, warm = results["cold"], results["warm"]
    for name, r in results.items():
        seconds = ", ".join(f"{k} {v:.2f}" for k, v in r["seconds"].items())
        print(f"{name}: first step {r['first_step']:.2f} s (whole process {r['process']:.1f} s), "
              f"cache {r['cache']}; seconds: {seconds}")
    print(f"warm/cold first step: {cold['first_step'] / warm['first_step']:.1f}x faster warm; "
          f"losses over {args.steps} steps bit-identical: {cold['losses'] == warm['losses']}")


if __name__ == "__main__":
    main()
