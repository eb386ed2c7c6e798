"""Inductor's kernels compile in the background while the next regions compile: its module waits for them as it loads
(`async_compile.wait(globals())`), which left its workers mostly idle; the wait is put off to the stage's end."""

import contextlib
import threading

_PATCHING = threading.RLock()  # one thread at a time patches `AsyncCompile.wait`, or waits (TritonBundler is global)
_RUNS_MODULES_WHILE_COMPILING = ("max_autotune", "max_autotune_gemm", "max_autotune_pointwise", "cpp_wrapper",
                                 "benchmark_fusion")  # Inductor options (epilogue benchmarking needs max_autotune)


@contextlib.contextmanager
def kernels_awaited_later():
    """Inside: the modules Inductor loads in this thread leave their kernels compiling; their (AsyncCompile,
    scope) pairs are collected in the list yielded. Off where Inductor runs modules as it compiles."""
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile
    pending: list[tuple] = []
    if any(getattr(config, flag, False) for flag in _RUNS_MODULES_WHILE_COMPILING):
        yield pending
        return
    with _PATCHING:
        real, thread = AsyncCompile.wait, threading.get_ident()

        def collect(self, scope):
            return pending.append((self, scope)) if threading.get_ident() == thread else real(self, scope)
        collect.real = real
        AsyncCompile.wait = collect
        try:
            yield pending
        finally:
            AsyncCompile.wait = real


def wait_for_kernels(compiled, pending: list) -> None:
    """Waits for the kernels of `pending` (emptied once all compiled; one that failed raises, again if called again)
    and bundles them into `compiled` beside those Inductor bundled, as it does when it waits: for the cache."""
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.triton_bundler import TritonBundler
    with _PATCHING:
        TritonBundler.begin_compile()
        try:
            wait = AsyncCompile.wait
            while hasattr(wait, "real"):  # this thread may be compiling another region
                wait = wait.real
            for instance, scope in pending:
                wait(instance, scope)
            pending.clear()
            bundle, _ = TritonBundler.collect()
            if (before := getattr(compiled, "_triton_bundle", None)) is not None:
                bundle = type(bundle)(before.kernel_artifacts + bundle.kernel_artifacts,
                                      before.static_autotuners + bundle.static_autotuners)
            compiled.set_triton_bundle(bundle)
        finally:
            TritonBundler.end_compile()
