"""GPU training benchmark: a Llama-style ~1B model, bf16, fused AdamW; one run, same model and data
for every row — eager, torch.compile, and pipeline.jit with several executor lists.

    python benchmarks/train_gpu.py                 # the acceptance rows, full config (H200: ~9 minutes)
    python benchmarks/train_gpu.py --all           # every row (split it with --resume)
    python benchmarks/train_gpu.py --layers 2      # a quick look
    python benchmarks/train_gpu.py --profile       # + GPU time per executor and the top kernels
    python benchmarks/train_gpu.py --device cpu --layers 1 --batch 1 --seq 32 --steps 6   # smoke test
    python benchmarks/train_gpu.py --resume /tmp/rows.json --only eager torch.compile   # one run in
    python benchmarks/train_gpu.py --resume /tmp/rows.json                               # two commands
    python benchmarks/train_gpu.py --cache --only "torch.compile" "pipeline.jit [inductor] + cuda graphs"
    python benchmarks/train_gpu.py --model hf      # the same rows on HF LlamaForCausalLM (or qwen2)
    python benchmarks/train_gpu.py --model hf --without causal_attention   # what a default pass gains

Rows ending in "+ cuda graphs" jit with `cuda_graphs=True` (each stage replayed as one CUDA graph);
"torch.compile reduce-overhead" is torch.compile with its CUDA graphs; "torchao float8 + torch.compile"
is torchao's float8 training (tensorwise) on every linear whose dims are multiples of 16, compiled.

Each row runs in its own process with its own empty Inductor and Triton caches (clean peak memory,
no state or compiled kernel shared between rows), with a time limit (--row-timeout), so one row
that compiles too long is reported and the others still run. The pipeline's compiled-artifact cache
is off, unless `--cache`: then each row runs twice, "(cold)" and "(warm)", in two fresh processes that
share that row's cache dirs (the pipeline's, Inductor's FX/AOT and Triton's), empty for the cold one,
with the pipeline's cache on as users run it (torch.compile rows: its own caches kept the same way).
`compile s` is then the sum of compile_stats' seconds of a pipeline row, to set beside its first step.

Columns: tokens/s over steps 5-20, MFU = (6·params + 12·layers·seq·dim) FLOPs per token against
790 TFLOP/s (the bf16 matmul rate measured on the H200), first-step (compile) time, peak memory
(torch.cuda.max_memory_allocated), and the 20-step loss curve's max deviation from eager.
"""
import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

# First steps are measured cold: the pipeline's compiled-artifact cache stays off unless asked for.
os.environ.setdefault("PIPELINE_CACHE", "0")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import pipeline  # noqa: E402
from models import LanguageModelLoss, Llama, LlamaConfig  # noqa: E402

PEAK_FLOPS = 790e12
DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


ROWS = ["eager", "torch.compile", "torch.compile reduce-overhead", "torchao float8 + torch.compile",
        "pipeline.jit [inductor]", "pipeline.jit [inductor] + cuda graphs",
        "pipeline.jit [te fp8 delayed, inductor]", "pipeline.jit [te fp8 delayed, inductor] + cuda graphs",
        "pipeline.jit [te, inductor] bf16", "pipeline.jit [te, inductor] bf16 + cuda graphs",
        "pipeline.jit [te grouped, inductor] bf16 + cuda graphs",
        "pipeline.jit [te fp8 delayed, nvfuser, inductor]", "pipeline.jit [te fp8 delayed, nvfuser, inductor] + cuda graphs",
        "pipeline.jit [te, nvfuser, inductor] bf16", "pipeline.jit [te, nvfuser, inductor] bf16 + cuda graphs",
        "pipeline.jit [nvfuser, inductor]", "pipeline.jit [nvfuser, inductor] + cuda graphs",
        "pipeline.jit [nvfuser]", "pipeline.jit [nvfuser] + cuda graphs",
        "pipeline.jit [nvfuser, inductor] autotune + cuda graphs",
        "pipeline.jit [te fp8 current, nvfuser, inductor]", "pipeline.jit [te fp8 current, inductor]",
        "pipeline.jit [te fp8 delayed ungrouped, inductor]", "pipeline.jit [inductor] + group_linears"]

# The acceptance rows, each pipeline row with CUDA graphs (the way to run it on this GPU):
# what a plain run measures. --only picks any rows, --all runs every row.
ACCEPTANCE = ["eager", "torch.compile", "torch.compile reduce-overhead", "torchao float8 + torch.compile",
              "pipeline.jit [inductor] + cuda graphs",
              "pipeline.jit [nvfuser, inductor] + cuda graphs",
              "pipeline.jit [te, nvfuser, inductor] bf16 + cuda graphs",
              "pipeline.jit [te fp8 delayed, nvfuser, inductor] + cuda graphs",
              "pipeline.jit [te fp8 delayed, inductor] + cuda graphs"]


def executors_of(name):
    """None for eager, "compile" for torch.compile, else the executor list of a pipeline row."""
    if name == "eager":
        return None
    if name.startswith("torch.compile") or name.startswith("torchao"):
        return "compile"
    import executors
    listed = name[name.index("[") + 1:name.index("]")].split(", ")
    out = []
    for item in listed:
        if item.startswith("te"):  # te [fp8 current|delayed] [grouped|ungrouped]
            te = executors.te
            if "fp8" in item:
                recipe = None
                if "delayed" in item:
                    from transformer_engine.common.recipe import DelayedScaling
                    recipe = DelayedScaling()
                te = te.fp8(recipe)
            # te's default groups linears in fp8 only; "grouped" / "ungrouped" choose explicitly
            out.append(te.options(group_linears=False if "ungrouped" in item else True if "grouped" in item else None))
        else:
            out.append(item)
    return out


def gpu_time_by_executor(step_fn, tokens):
    """GPU ms per (stage, executor) for one step, from pipeline.profile, plus the top regions."""
    table = pipeline.profile(step_fn, tokens)
    by = collections.Counter()
    for r in table:
        by[f"{r.stage}:{r.executor}"] += r.ms
    top = sorted(table, key=lambda r: -r.ms)[:10]
    return {"ms_by_stage_executor": {k: round(v, 2) for k, v in by.most_common()},
            "top_regions": [f"{r.id} {r.stage} {r.executor} {r.ms:.2f}ms x{r.calls}: {r.ops}" for r in top]}


def top_kernels(step, n=30, trace_file=None):
    """The GPU kernels of one training step by total time: which kernels an executor launches, how
    often, and what they cost (e.g. TE's casts and GEMMs); then where the GPU sat idle and what the
    CPU was doing meanwhile (`gpu_gaps.py`)."""
    from torch.profiler import ProfilerActivity, profile

    from executors.compiled_region import CompiledRegion
    from gpu_gaps import chrome_trace, idle_gaps, kernel_kinds
    CompiledRegion.profiling = True  # regions as named ranges, to attribute idle time to them
    try:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])) as prof:
            step()
            sync()
    finally:
        CompiledRegion.profiling = False
    field = "self_device_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, field, 0) > 0]
    events.sort(key=lambda e: -getattr(e, field))
    total = sum(getattr(e, field) for e in events) / 1e3
    kernels = [f"total {total:.1f} ms in kernels"] + [
        f"{getattr(e, field) / 1e3:7.2f} ms x{e.count:<4} {e.key[:110]}" for e in events[:n]]
    if DEVICE != "cuda":
        return kernels, []
    trace = chrome_trace(prof, trace_file)
    return kernels, kernel_kinds(trace) + idle_gaps(trace)


def host_profile(step_fn, opt, tokens, calls=10, top=22):
    """Where the CPU time of the forward and backward calls goes (cProfile over `calls` steps, each
    started on an idle GPU as in the timed loop): the part of the forward call before its first
    launch is time the GPU waits at every step."""
    import cProfile
    out = {}
    for phase in ("forward", "backward"):
        prof = cProfile.Profile()
        for _ in range(calls):
            sync()
            if phase == "forward":
                prof.enable()
            loss = step_fn(tokens)
            prof.disable()
            if phase == "backward":
                prof.enable()
            loss.backward()
            prof.disable()
            opt.zero_grad(set_to_none=True)
        sync()
        out[f"host_profile_{phase} (cProfile, {calls} calls)"] = profile_lines(prof, top)
    return out


def profile_lines(prof, top: int) -> list[str]:
    """The `top` functions of a cProfile run by cumulative and by own time, site-packages paths cut."""
    import io
    import pstats
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return [re.sub(r"\S*site-packages/", "", line.rstrip())[:170] for line in text.getvalue().splitlines()
            if re.match(r"\s*[0-9/]+\s+[0-9.]", line)]


class HFLoss(torch.nn.Module):
    """An unmodified Hugging Face causal LM as its users train it: the loss from `labels`."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(input_ids=tokens, labels=tokens).loss


def build_model(kind: str, config):
    """The benchmark's model: the hand-written Llama ("llama"), or a Hugging Face model of the same
    sizes built from its config with random weights ("hf": LlamaForCausalLM; "qwen2": Qwen2ForCausalLM,
    which adds q/k/v biases)."""
    if kind == "llama":
        # the loss in fp32, as training scripts compute it: the loss-curve column then resolves
        # differences well below one bf16 ulp of the loss (0.06 at 10)
        return LanguageModelLoss(Llama(config), fp32_loss=True)
    import transformers
    family = {"hf": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
              "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    hf_config = family[0](vocab_size=config.vocab, hidden_size=config.dim, intermediate_size=config.hidden,
                          num_hidden_layers=config.layers, num_attention_heads=config.heads,
                          num_key_value_heads=config.kv_heads, max_position_embeddings=config.max_seq,
                          rms_norm_eps=config.eps, rope_theta=config.rope_base, tie_word_embeddings=False)
    hf_config._attn_implementation = "sdpa"
    return HFLoss(family[1](hf_config))  # HF's loss upcasts the logits to fp32 itself


def float8_training(model):
    """torchao's float8 training (tensorwise scaling) on every linear whose dims are multiples of 16."""
    from torchao.float8 import convert_to_float8_training
    return convert_to_float8_training(
        model, module_filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear)
        and mod.in_features % 16 == 0 and mod.out_features % 16 == 0)


def saved_for_backward(step_fn, tokens, parameters, top=10) -> list[str]:
    """What one step's forward keeps for the backward (autograd's saved-tensor hooks): distinct
    storages other than the parameters', by dtype and shape, largest first. Blind inside a CUDA-graph
    replay (no row with one)."""
    seen, kept = {}, {p.untyped_storage().data_ptr() for p in parameters}

    def pack(t):
        inner = [getattr(t, a) for a in t.__tensor_flatten__()[0]] if hasattr(t, "__tensor_flatten__") else [t]
        for x in inner:
            if isinstance(x, torch.Tensor) and x.device.type != "meta":
                storage = x.untyped_storage()
                if storage.data_ptr() not in kept:
                    seen[storage.data_ptr()] = (str(x.dtype).replace("torch.", ""), tuple(x.shape), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step_fn(tokens)
    loss.backward()
    groups = collections.defaultdict(lambda: [0, 0])
    for dtype, shape, nbytes in seen.values():
        groups[dtype, shape][0] += 1
        groups[dtype, shape][1] += nbytes
    total = sum(n for _, n in groups.values())
    by_dtype = collections.Counter()
    for (dtype, _), (_, n) in groups.items():
        by_dtype[dtype] += n
    lines = [f"total {total / 2**30:.2f} GiB in {len(seen)} storages (parameters not counted); by dtype: "
             + ", ".join(f"{d} {n / 2**30:.2f}" for d, n in by_dtype.most_common())]
    for (dtype, shape), (count, n) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"{n / 2**30:6.2f} GiB  {count:3d} x {dtype} {list(shape)}")
    return lines


def _gc_timer():
    """Starts timing Python's collections; the returned function stops and says what they took: seconds, counts by
    generation, and each full collection (seconds, whether old objects were frozen or it walked the whole heap, and
    the phase it fell in: the outermost frames of the pipeline, Dynamo, AOTAutograd, autograd or the optimizer)."""
    import gc
    from pipeline.compiler import _gc_frozen  # whether the pipeline froze old objects (gc.get_freeze_count walks them)
    spent, started, counts, full = [0.0], [0.0], [0, 0, 0], []

    def callback(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            took = time.perf_counter() - started[0]
            spent[0] += took
            counts[info["generation"]] += 1
            if info["generation"] == 2:  # the costly ones
                full.append((round(took, 3), "frozen" if _gc_frozen[0] else "whole heap", _phase()))

    def _phase():
        frame, names = sys._getframe(2), []
        while frame is not None:
            path = frame.f_code.co_filename
            if re.search(r"/(pipeline|executors)/|torch/(_dynamo|_functorch|autograd|optim)/", path):
                names.append(f"{os.path.basename(path)}:{frame.f_code.co_name}")
            frame = frame.f_back
        names.reverse()  # outermost first
        return " > ".join(names if len(names) <= 4 else names[:2] + ["..."] + names[-2:])

    gc.callbacks.append(callback)

    def stop():
        gc.callbacks.remove(callback)
        return {"seconds": round(spent[0], 3), "collections by generation": counts, "full collections": full}
    return stop


def run_row(name, how, config, batches, args):
    profile, first_step_profile = args.profile, args.first_step_profile
    torch.manual_seed(0)
    model = build_model(args.model, config).to(DEVICE, torch.bfloat16)
    if name.startswith("torchao"):
        model = float8_training(model)
    if how is None:
        step_fn = model
    elif how == "compile":
        step_fn = torch.compile(model, mode="reduce-overhead" if name.endswith("reduce-overhead") else None)
    else:
        from transforms import group_linears
        transforms = [group_linears()] if name.endswith("+ group_linears") else []
        step_fn = pipeline.jit(model, executors=how, cuda_graphs=name.endswith("+ cuda graphs"),
                               autotune="] autotune" in name,
                               transforms=transforms + ([pipeline.without(*args.without)] if args.without else []))
        skipped = [f for f in pipeline.compile_stats(step_fn).fallbacks if "is not available" in f]
        if skipped:  # a row measures the executors its name lists, or says why it cannot
            raise RuntimeError("; ".join(skipped))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=DEVICE == "cuda")
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times, host = [], [], []
    first = None
    if first_step_profile:  # where the first step's host time goes (compile, cache, capture), cProfile
        import cProfile
        first = cProfile.Profile()
    stop_gc_timer, first_step_gc = _gc_timer(), None  # what the first step's garbage collections take
    for tokens in batches:
        sync()
        start = time.perf_counter()
        if len(times) == 1:
            first_step_gc = stop_gc_timer()
        if first is not None and not times:
            first.enable()
        loss = step_fn(tokens)
        t_forward = time.perf_counter()
        loss.backward()
        if first is not None and not times:
            first.disable()
        t_backward = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t_optimizer = time.perf_counter()
        sync()
        end = time.perf_counter()
        times.append(end - start)
        host.append((t_forward - start, t_backward - t_forward, t_optimizer - t_backward, end - t_optimizer))
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else float("nan")
    # where a timed step's wall time goes on the CPU: returning from the calls (launch work), then
    # waiting for the GPU. A step whose calls return late keeps the GPU idle at its start.
    timed = host[4:] or host  # steps 5-20, as tokens/s
    extra = {"host_ms": {k: round(1e3 * sum(h[i] for h in timed) / len(timed), 2) for i, k in
                         enumerate(["forward call", "backward call", "optimizer call", "wait for the GPU"])}}
    extra["first_step_gc"] = first_step_gc or stop_gc_timer()  # a run of one step: its only step
    if first is not None:
        extra["first_step_profile (cProfile)"] = profile_lines(first, 60)
        if args.trace_dir:  # the whole profile, for pstats
            os.makedirs(args.trace_dir, exist_ok=True)
            first.dump_stats(os.path.join(args.trace_dir, re.sub(r"[^A-Za-z0-9]+", "_", name) + ".prof"))
    # torch's own timers of its compile phases (dynamo_timed: Dynamo, AOTAutograd, Inductor's codegen,
    # waiting for Triton's compile workers), summed over the run: which of torch's phases a first step waits on
    from torch._dynamo.utils import compilation_time_metrics
    extra["torch_phases_s"] = dict(sorted(((k, round(sum(v), 2)) for k, v in compilation_time_metrics.items()
                                           if sum(v) >= 0.05), key=lambda kv: -kv[1])[:30])
    if how not in (None, "compile"):
        table = pipeline.regions(step_fn)
        extra["ops_by_executor"] = table.by_executor()
        extra["regions_by_executor"] = dict(collections.Counter(r.executor for r in table))
        # where the first step's compile time went: capture, lower, passes, dispatch, compile:<executor>
        extra["compile_seconds"] = {k: round(v, 1) for k, v in pipeline.compile_stats(step_fn).seconds.items()}
        extra["fp8_gemm_flop_share"] = table.fp8_gemm_flop_share()
        # the regions that took compile (or load) time, slowest first: what a cold or warm start waits for
        extra["slowest_regions"] = [f"{r.stage} {r.id} {r.executor} {r.op_count} ops {r.compile_seconds:.2f} s"
                                    for r in sorted(table, key=lambda r: -r.compile_seconds)[:25]
                                    if r.compile_seconds > 0.02]
        # the same seconds summed by executor (a warm start's "cache load": which executor's regions it is)
        seconds_by_executor = collections.Counter()
        for r in table:
            seconds_by_executor[r.executor] += r.compile_seconds
        extra["region_seconds_by_executor"] = {k: round(v, 2) for k, v in seconds_by_executor.most_common()}
        extra["autotune"] = [line for line in str(table).splitlines() if " autotuned: " in line]
        graphs = pipeline.compile_stats(step_fn).cuda_graphs
        if graphs:
            extra["cuda_graphs"] = graphs
        if profile and "on" not in graphs.values():  # replayed graphs have no regions to time
            extra.update(gpu_time_by_executor(step_fn, batches[0]))
            opt.zero_grad(set_to_none=True)  # else the profiled step below adds into these gradients
    if args.host_profile:
        extra.update(host_profile(step_fn, opt, batches[0]))
    replayed = how not in (None, "compile") and "on" in pipeline.compile_stats(step_fn).cuda_graphs.values()
    if args.saved_tensors:
        extra["saved_for_backward"] = (["not measurable: the stages replay as CUDA graphs"] if replayed
                                       else saved_for_backward(step_fn, batches[0], model.parameters()))
        opt.zero_grad(set_to_none=True)
    if args.peak_memory:
        if replayed or DEVICE != "cuda":
            extra["peak_memory"] = ["not measurable: the stages replay as CUDA graphs, or no GPU"]
        else:
            from memory_peak import held_at_backward_start, peak_breakdown, record_step

            def recorded_step():
                step_fn(batches[0]).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            extra["peak_memory"] = peak_breakdown(record_step(recorded_step))
            state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            extra["peak_memory"] += held_at_backward_start(lambda: step_fn(batches[0]), lambda loss: loss.backward(),
                                                           kept=[*model.parameters(), *model.buffers(), *state])
            opt.zero_grad(set_to_none=True)
    if profile:
        def one_step():
            step_fn(batches[0]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        trace = os.path.join(args.trace_dir, name.replace(" ", "_").replace(",", "") + ".json") if args.trace_dir else None
        extra["top_kernels"], extra["gpu_idle"] = top_kernels(one_step, trace_file=trace)
    return losses, times, peak, extra


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", nargs="*", default=[], help="row names, or substrings of row names, to run")
    parser.add_argument("--all", action="store_true", help="every row (default: the acceptance rows)")
    parser.add_argument("--profile", action="store_true",
                        help="GPU time per executor (pipeline rows), top kernels, and where the GPU sat idle")
    parser.add_argument("--host-profile", action="store_true",
                        help="where the CPU time of the forward and backward calls goes (cProfile)")
    parser.add_argument("--model", default="llama", choices=["llama", "hf", "qwen2"],
                        help="the hand-written Llama, or HF LlamaForCausalLM / Qwen2ForCausalLM of the same sizes")
    parser.add_argument("--without", nargs="*", default=[],
                        help="default passes the pipeline rows leave out (pipeline.without): what they gain")
    parser.add_argument("--saved-tensors", action="store_true",
                        help="+ what a step keeps for its backward, by dtype and shape (rows without CUDA graphs)")
    parser.add_argument("--peak-memory", action="store_true",
                        help="what is alive at a step's peak and where it was allocated (rows without CUDA graphs)")
    parser.add_argument("--first-step-profile", action="store_true",
                        help="where the first step's host time goes (cProfile: compile, cache loads, capture); "
                             "with --cache only the last warm run is profiled, so the others' times stay clean")
    parser.add_argument("--trace-dir", default=None, help="with --profile: keep each row's chrome trace here")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of the script")
    parser.add_argument("--row-timeout", type=float, default=300, help="seconds per row, compile included")
    parser.add_argument("--cache", action="store_true",
                        help="each row cold then warm (a second process) with its caches kept; pipeline cache on")
    parser.add_argument("--warm-runs", type=int, default=1,
                        help="with --cache: this many warm processes after the cold one (their spread)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--resume", default=None,
                        help="a file of rows measured so far: rows in it are not run again, new rows are added "
                             "to it, and the table shows them all (one run split over several commands)")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)       # internal: run one row
    parser.add_argument("--row-json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    config = LlamaConfig.llama_1b()
    config.layers, config.max_seq = args.layers, args.seq
    if args.row is not None:
        return run_one(args, config)

    params = Llama(LlamaConfig(**{**config.__dict__, "layers": 0})).num_params() + \
        args.layers * sum(p.numel() for p in Llama(LlamaConfig(**{**config.__dict__, "layers": 1})).layers.parameters())
    flops_per_token = 6 * params + 12 * config.layers * args.seq * config.dim
    tokens_per_step = args.batch * args.seq
    model_name = {"llama": "Llama-style (hand-written)", "hf": "HF LlamaForCausalLM", "qwen2": "HF Qwen2ForCausalLM"}[args.model]
    print(f"{model_name} {params / 1e9:.2f}B params, {config.layers} layers, batch {args.batch} x seq {args.seq}, "
          f"bf16, fused AdamW, {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU'}, torch {torch.__version__}"
          + (f"; pipeline rows without the default passes {args.without}" if args.without else ""), flush=True)
    print(f"{'':50} {'tokens/s':>9} {'MFU':>6} {'1st step s':>10} {'peak GiB':>9} {'max |Δloss|':>11}", flush=True)
    results, eager_losses = [], None
    done = {}  # rows measured by an earlier command of the same run (--resume)
    settings = {k: getattr(args, k) for k in ("layers", "batch", "seq", "steps", "device", "model", "without")}
    if args.resume and os.path.exists(args.resume):
        with open(args.resume) as f:
            done = json.load(f)
        if done.pop("settings", settings) != settings:
            raise SystemExit(f"--resume {args.resume}: its rows were measured with other settings; "
                             f"use a new file for {settings}")
    if args.only:
        selected = [r for r in ROWS if any(o == r or (o in r and o not in ROWS) for o in args.only)]
    else:
        selected = ROWS if args.all else ACCEPTANCE
    names = [r for r in ROWS if r in selected or r in done]
    if args.cache:
        whens = ["cold", "warm"] + [f"warm {i}" for i in range(2, args.warm_runs + 1)]
        names = [f"{r} ({when})" for r in names for when in whens]
        kept = tempfile.TemporaryDirectory()  # each row's cache dirs, shared by its cold and warm runs
    for name in names:
        caches = os.path.join(kept.name, re.sub(r"[^A-Za-z0-9]+", "_", row_of(name))) if args.cache else None
        result = done.get(name) or run_in_subprocess(name, args, caches)
        if args.resume and name not in done and "error" not in result:
            done[name] = result
            with open(args.resume, "w") as f:
                json.dump({"settings": settings, **done}, f)
        if "error" in result:
            print(f"{name:50} failed: {result['error'].splitlines()[0][:300]}", flush=True)
            results.append(result)
            continue
        losses, times = result["losses"], result["times"]
        eager_losses = eager_losses or (losses if row_of(name) == "eager" else None)
        steady = times[4:] or times[1:] or times  # steps 5 on, when there are
        tps = tokens_per_step * len(steady) / sum(steady)
        mfu = tps * flops_per_token / PEAK_FLOPS
        dev = max(abs(a - b) for a, b in zip(losses, eager_losses)) if eager_losses else float("nan")
        counted = sum(result["extra"].get("compile_seconds", {}).values())
        print(f"{name:50} {tps:9.0f} {mfu:6.1%} {times[0]:10.1f} {result['peak']:9.2f} {dev:11.2e}"
              + (f"   compile_stats {counted:.1f} s ({counted / times[0]:.0%} of the 1st step)" if counted else ""),
              flush=True)
        for key, value in result["extra"].items():
            if isinstance(value, list) and not value:
                continue
            if isinstance(value, list):
                print(f"    {key}:\n" + "\n".join(f"      {v}" for v in value), flush=True)
            else:
                print(f"    {key}: {value}", flush=True)
        results.append({"row": name, "tokens_per_s": tps, "mfu": mfu, "first_step_s": times[0],
                        "peak_gib": result["peak"], "max_loss_dev": dev, "losses": losses, **result["extra"]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def row_of(name: str) -> str:
    """The row a `--cache` run belongs to: its name without " (cold)" / " (warm)" / " (warm 2)"."""
    return re.sub(r" \((cold|warm|warm \d+)\)$", "", name)


def run_in_subprocess(name, args, kept_caches=None):
    """One row in a fresh process, within --row-timeout seconds. Its compiler caches are empty
    (no row's first step reuses kernels an earlier row built), or `kept_caches` (--cache: the cold
    and warm runs of one row share them, and the pipeline's cache is on)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out, tempfile.TemporaryDirectory() as fresh:
        caches = kept_caches or fresh
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
               "TRITON_CACHE_DIR": os.path.join(caches, "triton")}
        if kept_caches:
            env.update(PIPELINE_CACHE="1", PIPELINE_CACHE_DIR=os.path.join(caches, "pipeline"))
        cmd = [sys.executable, __file__, "--row", name, "--row-json", out.name, "--layers", str(args.layers),
               "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
               "--device", args.device, "--model", args.model]
        cmd += ["--profile"] if args.profile else []
        cmd += ["--trace-dir", args.trace_dir] if args.trace_dir else []
        cmd += ["--host-profile"] if args.host_profile else []
        last_warm = f"({'warm' if args.warm_runs < 2 else f'warm {args.warm_runs}'})"
        cmd += ["--first-step-profile"] if args.first_step_profile and (not kept_caches or name.endswith(last_warm)) else []
        cmd += ["--saved-tensors"] if args.saved_tensors else []
        cmd += ["--peak-memory"] if args.peak_memory else []
        cmd += ["--without", *args.without] if args.without else []
        watched = [caches, os.path.expanduser("~/.nv"), os.path.expanduser("~/.triton"), os.path.expanduser("~/.cache")]
        before = files_under(watched) if kept_caches else {}
        try:
            proc = subprocess.run(cmd, timeout=args.row_timeout, capture_output=True, text=True, env=env)
        except subprocess.TimeoutExpired:
            return {"row": name, "error": f"did not finish within --row-timeout {args.row_timeout:.0f} s"}
        try:
            with open(out.name) as f:
                result = json.load(f)
            if kept_caches and "extra" in result:  # what a warm process still writes (cold: what it fills)
                result["extra"]["files_written"] = written_since(before, files_under(watched), caches)
            return result
        except (OSError, ValueError):
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
            return {"row": name, "error": f"exit {proc.returncode}: " + " | ".join(tail)}


def files_under(folders) -> dict:
    """{path: (size, mtime)} of every file under `folders`."""
    found = {}
    for folder in folders:
        for root, _, names in os.walk(folder):
            for n in names:
                path = os.path.join(root, n)
                with contextlib.suppress(OSError):
                    st = os.stat(path)
                    found[path] = (st.st_size, st.st_mtime_ns)
    return found


def written_since(before: dict, after: dict, caches: str) -> dict:
    """Files new or changed between two `files_under`, counted (and MB) by folder: which cache a process wrote."""
    by_folder = collections.defaultdict(lambda: [0, 0.0])
    for path, (size, mtime) in after.items():
        if before.get(path) != (size, mtime):
            rel = os.path.relpath(path, caches) if path.startswith(caches) else path.replace(os.path.expanduser("~"), "~")
            folder = "/".join(rel.split("/")[:2])
            by_folder[folder][0] += 1
            by_folder[folder][1] = round(by_folder[folder][1] + size / 2**20, 2)
    return dict(by_folder)


def run_one(args, config):
    # Two batches of random tokens, alternating: the model memorizes them, so the loss falls over
    # the 20 steps and the loss-curve column compares curves, not noise around a flat line.
    g = torch.Generator().manual_seed(1)
    pool = [torch.randint(0, config.vocab, (args.batch, args.seq), generator=g).to(DEVICE) for _ in range(2)]
    batches = [pool[i % 2] for i in range(args.steps)]
    try:
        row = row_of(args.row)
        losses, times, peak, extra = run_row(row, executors_of(row), config, batches, args)
        result = {"row": args.row, "losses": losses, "times": times, "peak": peak, "extra": extra}
    except Exception as e:  # a row that cannot run says why; the others still run
        result = {"row": args.row, "error": f"{type(e).__name__}: {e}"[:2000]}
    with open(args.row_json, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
