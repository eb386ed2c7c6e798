"""Regions compiled in parallel worker processes (docs/executors.md, "Compiling in parallel").

Dispatch builds regions one after another, and Inductor spends most of a first step in its own
Python (lowering, scheduling, code generation), one region at a time. An executor with
`compile_workers > 0` (and `save_region`/`load_region`) has each distinct region compiled in a worker
process while dispatch goes on, then loads the bytes as it loads a cached artifact. The workers are
torch's `SubprocPool`, as Inductor's own compile workers; a worker applies this process's settings
and checks that the executor's `cache_token` came out the same, so what it compiled is what this
process would have compiled. Anything a worker could not do is compiled in this process as before.
"""
from __future__ import annotations

import atexit
import functools
import pickle
from concurrent.futures import Future
from typing import Optional, Sequence

import torch
import torch.fx as fx

from ir import node_value, trace_pickle

from .artifact_files import _artifact_files_root, set_artifact_files_root


def submit(ex, gm: fx.GraphModule) -> Optional[Future]:
    """A future of `ex.save_region(ex.compile_region(gm, ...))` computed in a worker, or None when
    the region cannot travel (it does not pickle)."""
    try:
        job = pickle.dumps((ex, ex.cache_token(), _settings())), trace_pickle.dumps(gm)
    except Exception:
        return None
    return _pool(ex.compile_workers).submit(_compile, *job)


def result(future: Future) -> tuple[Optional[bytes], Optional[str]]:
    """(the worker's bytes, None), or (None, why the worker could not compile the region)."""
    try:
        return future.result(), None
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"


def start(workers: int) -> None:
    """Starts the workers now: each imports torch (seconds), which then overlaps capture and lowering."""
    _pool(workers)


@functools.cache
def _pool(workers: int):
    """Spawned, not forked: torch's pool process has CUDA initialized, and a forked child cannot use it."""
    from torch._inductor.compile_worker.subproc_pool import SubprocKind, SubprocPool
    pool = SubprocPool(workers, kind=SubprocKind.SPAWN)
    atexit.register(pool.shutdown)
    return pool


def _settings() -> dict:
    """What a region's compiled code depends on beyond its graph and executor, global to a process."""
    from torch._inductor import config
    matmul = torch.backends.cuda.matmul
    return {"artifact_root": list(_artifact_files_root), "inductor": config.save_config_portable(ignore_private_configs=False),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "float32_matmul": torch.get_float32_matmul_precision(),
            "matmul": (matmul.allow_tf32, matmul.allow_fp16_reduced_precision_reduction,
                       matmul.allow_bf16_reduced_precision_reduction)}


def _compile(job: bytes, graph: bytes) -> bytes:
    """In a worker: the region compiled and saved, under the settings of the process that sent it."""
    from torch._inductor import config
    from .plan import _compile_isolated
    ex, token, settings = pickle.loads(job)
    set_artifact_files_root((settings["artifact_root"] or [None])[0])
    config.load_config(settings["inductor"])
    config.compile_threads = 1  # the workers are the parallelism: no pool of their own
    torch.use_deterministic_algorithms(settings["deterministic"])
    torch.set_float32_matmul_precision(settings["float32_matmul"])
    matmul = torch.backends.cuda.matmul
    (matmul.allow_tf32, matmul.allow_fp16_reduced_precision_reduction,
     matmul.allow_bf16_reduced_precision_reduction) = settings["matmul"]
    if ex.cache_token() != token:
        raise RuntimeError(f"the worker's settings differ from the main process's:\n{ex.cache_token()}\n{token}")
    gm = trace_pickle.loads(graph)
    inputs: Sequence = [node_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    return ex.save_region(_compile_isolated(ex, gm, inputs))
