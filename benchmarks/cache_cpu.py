"""Cold vs warm first training step of the demo model through the compiled-artifact cache (CPU).

    python benchmarks/cache_cpu.py [--steps 3] [--executors inductor]

Runs the demo's Llama-style training (examples/demo.py: same model, data and AdamW) in two fresh
processes sharing one empty `PIPELINE_CACHE_DIR`: the cold one compiles and fills the cache, the
warm one finds it. Each gets its own empty `TORCHINDUCTOR_CACHE_DIR`, so the warm speed-up is ours,
not Inductor's. A third process runs with the cache off, for comparison. Prints the first-step
times, what `compile_stats` accounts for of each, their ratio, and whether the losses are identical.

Without `--deterministic` only the first step's loss is comparable bit for bit: Inductor's CPU
embedding backward accumulates with atomic adds, so two cold runs already differ from the third
step on. `--deterministic` (`torch.use_deterministic_algorithms(True)`) makes every step comparable.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(executors: list[str], steps: int, deterministic: bool) -> dict:
    """One process's training run: first-step time, losses, cache status per graph."""
    import torch
    torch.use_deterministic_algorithms(deterministic)

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
            "cache": stats.cache, "seconds": stats.seconds, "notes": [n for _, n in stats.cache_notes]}


def run(env: dict, executors: str, steps: int, deterministic: bool) -> dict:
    start = time.perf_counter()
    flags = ["--deterministic"] if deterministic else []
    out = subprocess.run([sys.executable, __file__, "--worker", "--executors", executors, "--steps", str(steps), *flags],
                         env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process"] = time.perf_counter() - start
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--executors", default="inductor")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.executors.split(","), args.steps, args.deterministic)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PIPELINE_CACHE_DIR": os.path.join(tmp, "pipeline"), "PIPELINE_CACHE": "1"}
        results = {}
        for name in ("cold", "warm", "off"):
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, f"inductor-{name}")  # fresh, empty
            env["PIPELINE_CACHE"] = "0" if name == "off" else "1"
            results[name] = run(env, args.executors, args.steps, args.deterministic)
    cold, warm = results["cold"], results["warm"]
    for name, r in results.items():
        seconds = ", ".join(f"{k} {v:.2f}" for k, v in r["seconds"].items())
        counted = sum(r["seconds"].values())
        print(f"{name}: first step {r['first_step']:.2f} s (whole process {r['process']:.1f} s), "
              f"compile_stats {counted:.2f} s ({counted / r['first_step']:.0%}), cache {r['cache']}; seconds: {seconds}")
        if name == "warm" and r["notes"]:
            print("    warm cache notes:", "; ".join(r["notes"]))
    same = [a == b for a, b in zip(cold["losses"], warm["losses"])]
    print(f"warm/cold first step: {cold['first_step'] / warm['first_step']:.1f}x faster warm; "
          f"loss bit-identical per step: {same}"
          + ("" if args.deterministic else " (later steps: see --deterministic)"))


if __name__ == "__main__":
    main()
