"""The `inductor` executor (docs/executors.md): ATen regions go straight to `compile_fx_inner`, as after AOTAutograd."""

import contextlib
import copy
import functools
import hashlib
import os
import pathlib
import pickle
import shutil
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch
import torch.fx as fx

from .artifact_files import Skipped, Untrusted, artifact_files_dir, environ_set, read_file, write_file
from .base import Cacheable, PerModel, PreparesGraph, RegionDeclined
from .graph_utils import (computes_nothing, donated_inputs, is_symbolic_glue, keep_promised_strides,
                          meta_strides_unreliable, op_name, promised_strides)
from .decompose import NotDecomposable, decompose_graph
from .inductor_kernels import kernels_awaited_later, wait_for_kernels


aten = torch.ops.aten
_triton_key_started: list = []  # the future of Triton's cache key, computed once per process


class InductorExecutor(Cacheable, PerModel, PreparesGraph):
    name = "inductor"
    kind = "fusion"

    def __init__(self, fallback_random: bool = False):
        self.fallback_random = fallback_random

    def options(self, *, fallback_random: bool = False) -> "InductorExecutor":
        """With `fallback_random=True`, random ops run with eager's kernels (docs/executors.md, "inductor")."""
        return InductorExecutor(fallback_random=fallback_random)

    def for_model(self) -> "InductorExecutor":
        """Starts Inductor's compile workers now, as torch.compile does: until up (seconds), kernels build serially."""
        with contextlib.suppress(Exception):  # an optimisation only: without workers, kernels compile in-process
            from torch._inductor.async_compile import maybe_warm_pool
            maybe_warm_pool()
        with contextlib.suppress(Exception):  # the same: Triton's cache key (~0.35 s), which triton.compile waits for
            if torch.cuda.is_available() and not _triton_key_started:  # here: imports in 2 threads may deadlock
                from torch._inductor.runtime.triton_compat import HAS_TRITON, triton_key
                if HAS_TRITON:  # hashed in a thread; a future: an exception stays in it, unraised
                    _triton_key_started.append(ThreadPoolExecutor(1, "triton_key").submit(triton_key))
        return self

    def unavailable_reason(self) -> str | None:
        try:
            import torch._inductor.compile_fx  # noqa: F401
        except Exception as e:  # pragma: no cover - torch builds without inductor
            return f"torch._inductor does not import: {e}"
        if not torch.cuda.is_available() and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
            return "Inductor on the CPU needs a C++ compiler (g++ or clang++) on PATH"
        return None

    def claims_op(self, op, node: fx.Node) -> bool:
        if is_symbolic_glue(op):
            return True
        if meta_strides_unreliable(node) or op in _REFUSED_HIGHER_ORDER_OPS:
            return False  # Inductor would assert the promised strides and fail; see _REFUSED_HIGHER_ORDER_OPS
        return op in _lowerings() or op in _decompositions(self.fallback_random)

    def library_ops(self) -> set:
        return _library_ops()

    def decompositions_before_partition(self) -> dict:
        """As torch.compile's AOTAutograd does: with `detach` and log-softmax whole, the partitioner saves the loss's
        fp32 log-probabilities (1 GiB at 8192 tokens x 32000); decomposed, the bf16 logits and two [tokens, 1] sums."""
        table = _decompositions(self.fallback_random)
        return {op: table[op] for op in _DECOMPOSE_BEFORE_PARTITION if op in table}

    def compile_region(self, gm: fx.GraphModule, example_inputs: Sequence):
        if reason := _nothing_to_fuse(gm):
            raise RegionDeclined(reason)
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx_inner

        with config.patch(fallback_random=self.fallback_random):
            decomposed = _inductor_decomposed(gm, example_inputs)
        donated = donated_inputs(gm)
        # No layouts of its own (others read the promised strides), no CUDA graphs (`cuda_graphs=True` records stages).
        with config.patch({"fallback_random": self.fallback_random, "layout_optimization": False,
                           "triton.cudagraphs": False}), \
                _donating(decomposed, donated), _kernel_dir(own := _own_dir()), kernels_awaited_later() as pending:
            compiled = compile_fx_inner(decomposed, list(example_inputs), is_backward=bool(donated))
        return InductorRegion(compiled, gm, pending, own)

    def finish_region(self, fn: "InductorRegion") -> None:
        fn.wait_for_kernels()

    def cache_token(self) -> str:
        """With the global flags Inductor bakes into kernels (its FX graph cache keys them too)."""
        from torch._inductor import config
        matmul = torch.backends.cuda.matmul
        return (f"inductor fallback_random={self.fallback_random} config={_portable_config_hash(config.get_hash())} "
                f"deterministic={torch.are_deterministic_algorithms_enabled()} "
                f"matmul={torch.get_float32_matmul_precision()},{matmul.allow_tf32},"
                f"{matmul.allow_fp16_reduced_precision_reduction},{matmul.allow_bf16_reduced_precision_reduction} "
                f"machine={_machine()}")

    def artifact_unsupported_reason(self, gm, example_inputs) -> str | None:
        if any(isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and not all(
                isinstance(s, int) for s in (*v.shape, *v.stride(), v.storage_offset()))) for v in example_inputs):
            return "inductor region with symbolic shapes"  # a stored kernel lacks the shape guards Inductor may add
        return None

    def save_region(self, fn: "InductorRegion") -> bytes:
        """The graph as Inductor's FX graph cache stores it, and its C++ kernels' libraries by path (none rebuilt)."""
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        stored = copy.copy(fn.compiled)
        stored.prepare_for_serialization()
        with _kernel_dir(_own_dir()):
            root = cache_dir()
            files = {os.path.relpath(p, root): pathlib.Path(p).read_bytes() for p in _kernel_libraries(fn.compiled)
                     if os.path.abspath(p).startswith(root + os.sep)}
        return pickle.dumps({"graph": pickle.dumps(stored), "files": files})

    def load_region(self, data: bytes, gm: fx.GraphModule, example_inputs: Sequence):
        """Loads with Inductor's cache dir set to ours (docs/cache.md, "What is checked before anything runs", 3.)."""
        from torch._inductor.output_code import CompiledFxGraphConstants
        from torch._inductor.utils import BoxedBool

        if (own := artifact_files_dir("inductor")) is None:
            raise RuntimeError("no private directory for Inductor's kernels (the pipeline cache is off)")
        stored = pickle.loads(data)
        for rel, content in stored["files"].items():
            _put_verified(own, rel, content)
        compiled, constants = pickle.loads(stored["graph"]), CompiledFxGraphConstants()
        with _kernel_dir(own):
            if bundle := getattr(compiled, "_triton_bundle", None):  # launched as bundled, not compiled again
                from torch._inductor.triton_bundler import TritonBundler
                TritonBundler.read_and_emit(bundle)
            compiled.after_deserialization(constants)   # imports the wrapper module, loads the kernels
        compiled.post_compile(list(example_inputs), constants,
                              {"cudagraphs": BoxedBool(False), "is_backward": False, "is_inference": False})
        return InductorRegion(compiled, gm)


class InductorRegion:
    """Inductor's `CompiledFxGraph`, outputs restrided as the trace promised; kernels compile until `finish_region`."""

    def __init__(self, compiled, gm: fx.GraphModule, pending=(), kernel_dir=None):
        self.compiled, self.kernel_dir = compiled, kernel_dir  # the cache dir its kernels compiled under
        self.pending = list(pending)  # (AsyncCompile, module scope) whose kernels may still be compiling
        self.restride = _mismatched_strides(gm, getattr(compiled, "output_strides", None))

    def wait_for_kernels(self) -> None:
        if self.pending:
            with _kernel_dir(self.kernel_dir):  # where the bundler finds the kernels: where they compiled
                wait_for_kernels(self.compiled, self.pending)

    def __call__(self, *args):
        return self.boxed(list(args))

    def boxed(self, args: list) -> tuple:
        """Inductor's own calling convention: it empties `args` and frees each input after its last use."""
        self.wait_for_kernels()  # none left once `finish_region` ran; outside dispatch, its kernels first
        return tuple(keep_promised_strides(list(self.compiled(args)), self.restride))


@contextlib.contextmanager
def _donating(gm: fx.GraphModule, donated: list[int]):
    """Lets Inductor reuse the region's donated inputs' memory (`mark_donated_inputs`), as in torch.compile's backward
    (indices in the tracing context's `fw_metadata`); renamed, so Inductor's FX graph cache keys the donation too."""
    if not donated:
        yield
        return
    from torch._guards import TracingContext, tracing
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i in donated:
        placeholders[i].name = placeholders[i].target = f"donated{i}"
    gm.recompile()
    with contextlib.nullcontext() if TracingContext.try_get() is not None else tracing(TracingContext(None)):
        ctx = TracingContext.get()
        saved = ctx.fw_metadata
        ctx.fw_metadata = types.SimpleNamespace(bw_donated_idxs=list(donated), static_input_indices=[])
        try:
            yield
        finally:
            ctx.fw_metadata = saved


def _kernel_libraries(compiled) -> set[str]:
    """The .so files the graph's C++ kernels loaded from, and if any, Inductor's ISA probe (else rebuilt: ~30 s)."""
    module = sys.modules.get(getattr(compiled.current_callable, "__module__", None) or "")
    owners = [getattr(value, "__self__", None) for value in (vars(module).values() if module is not None else ())]
    paths = {owner.__file__ for owner in owners
             if isinstance(owner, types.ModuleType) and str(getattr(owner, "__file__", "")).endswith(".so")}
    return paths | _isa_probe_libraries() if paths else paths


def _isa_probe_libraries() -> set[str]:
    try:
        from torch._inductor.codecache import get_hash, get_path
        from torch._inductor.cpu_vec_isa import _get_isa_dry_compile_fingerprint, pick_vec_isa
        if not (isa := pick_vec_isa()):
            return set()
        key = get_hash(isa._avx_code.strip(), _get_isa_dry_compile_fingerprint(isa.build_arch_flags()), "code")
        so = get_path(key, "so")[2]
        return {so} if os.path.exists(so) else set()
    except Exception:  # internal helpers differ between torch versions: then the probe is rebuilt
        return set()


def _own_dir() -> str | None:
    """`artifact_files_dir("inductor")`, or None also where it is unusable (then Inductor uses its own cache dir)."""
    try:
        return artifact_files_dir("inductor")
    except OSError:
        return None


def _kernel_dir(path: str | None):
    """Inductor's cache dir set to `path` (`environ_set`): Inductor and its workers read it from the environment."""
    return environ_set("TORCHINDUCTOR_CACHE_DIR", path)


def _put_verified(root: str, rel: str, content: bytes) -> None:
    """`content` at `root/rel`: a file there stays if its bytes are the same (a library loads from it); else written."""
    if not (path := os.path.normpath(os.path.join(root, rel))).startswith(root + os.sep):
        raise ValueError(f"artifact file {rel!r} lies outside the kernel directory")
    with contextlib.suppress(OSError, Skipped, Untrusted):  # else (absent, a link, not ours) written anew
        if read_file(path, "kernel file") == content:
            return
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    write_file(path, content, 0o700 if path.endswith(".so") else 0o600)


@functools.lru_cache(maxsize=8)
def _portable_config_hash(config_hash: bytes) -> str:
    """Inductor's config hashed as its FX graph cache does (`save_config_portable`: no compile_threads and such)."""
    from torch._inductor import config
    values = config.save_config_portable(ignore_private_configs=False)
    text = "\n".join(f"{k}={_stable_text(v)}" for k, v in sorted(values.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _stable_text(value) -> str:
    """`value` as the same text in every process; an object shown by its address, as one unique to this process."""
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_stable_text(v) for v in value)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_stable_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_stable_text(k)}: {_stable_text(v)}" for k, v in sorted(value.items(), key=repr)) + "}"
    if callable(getattr(value, "uuid", None)):
        return f"uuid {value.uuid()}"
    if hasattr(value, "__qualname__") and hasattr(value, "__module__"):
        return f"{value.__module__}.{value.__qualname__}"
    text = repr(value)
    return f"{text} pid {os.getpid()}" if " at 0x" in text else text


@functools.cache
def _machine() -> str:
    """What generated kernels depend on, read cheaply (Inductor's `get_system`, `pick_vec_isa` take seconds each)."""
    import importlib.metadata
    import platform
    parts = [platform.machine(), f"cuda {torch.version.cuda}", f"hip {torch.version.hip}",
             f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '')}"]
    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
    if torch.cuda.is_available():
        parts += [f"{torch.cuda.get_device_name(i)} {torch.cuda.get_device_capability(i)}"
                  for i in range(torch.cuda.device_count())]
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
        parts.append(" ".join(sorted(flags.split(":", 1)[-1].split())))
    except OSError:
        parts.append(platform.processor())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _library_ops():
    """Ops Inductor runs as library kernels (cuBLAS, cuDNN, flash attention) unless it autotunes its own templates."""
    attention = ("flash_attention", "efficient_attention", "cudnn_attention", "flash_attention_for_cpu")
    names = ["mm", "bmm", "addmm", "baddbmm", "convolution", "convolution_backward",
             *(f"_scaled_dot_product_{kind}{end}" for kind in attention for end in ("", "_backward"))]
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def _nothing_to_fuse(gm: fx.GraphModule) -> str | None:
    """Why Inductor would add nothing but compile time (the region holds only library kernels and views), or None."""
    from torch._inductor import config
    if config.max_autotune or config.max_autotune_gemm:  # it may pick its own GEMM templates
        return None
    library = _library_ops()
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    if not all(op in library or computes_nothing(op) for op in ops):
        return None
    names = sorted({op_name(op) for op in ops if op in library})
    return f"nothing to fuse (only library kernels {', '.join(names) or 'none'} and views); eager runs the same kernels"


def _mismatched_strides(region: fx.GraphModule, strides) -> list[tuple[int, tuple[int, ...]]]:
    """The promised strides of the outputs Inductor lays out differently (copied into them when run)."""
    actual = [_static_stride(stride) for stride in strides or ()]  # printed expressions: symbolic ones not compared
    return [(i, want) for i, want in promised_strides(region)
            if i < len(actual) and actual[i] is not None and actual[i] != want]


def _static_stride(stride) -> tuple[int, ...] | None:
    with contextlib.suppress(TypeError, ValueError):
        return None if stride is None else tuple(int(s) for s in stride)
    return None


def _inductor_decomposed(gm: fx.GraphModule, example_inputs: Sequence) -> fx.GraphModule:
    """Inductor's decompositions and graph rewrites, as torch.compile: else NLL's backward keeps `zeros + scatter`."""
    from torch._guards import detect_fake_mode
    from torch._inductor import config
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch.fx.experimental.proxy_tensor import make_fx

    table = _decompositions(config.fallback_random)
    fake_mode = detect_fake_mode(list(example_inputs))
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        try:
            decomposed = decompose_graph(gm, table)
        except NotDecomposable:
            decomposed = make_fx(gm, decomposition_table=table, tracing_mode="real")(*example_inputs)
        return joint_graph_passes(decomposed)


# Run on `torch`: Inductor returns None for `with_effects`' token, and (torch 2.13, CPU) wrong gradients for a
# `nested_compile_region` called twice, as torch.compile does (tests/test_subgraph_ops.py).
_REFUSED_HIGHER_ORDER_OPS = (torch.ops.higher_order.with_effects, torch.ops.higher_order.invoke_subgraph)
_DECOMPOSE_BEFORE_PARTITION = tuple(getattr(aten, op).default for op in (
    "detach", "_log_softmax", "_log_softmax_backward_data", "_softmax", "_softmax_backward_data", "nll_loss_backward"))


@functools.cache
def _lowerings():
    from torch._inductor.lowering import lowerings
    return lowerings


@functools.cache
def _decompositions(fallback_random: bool):
    from torch._inductor import config
    from torch._inductor.decomposition import select_decomp_table
    with config.patch(fallback_random=fallback_random):
        return select_decomp_table()


inductor_executor = InductorExecutor()
