"""The `inductor` executor matches eager within fp32 tolerance (forward, gradients, buffers)."""
import pytest
import torch

import pipeline
from helpers import assert_same_grads, run_both
from models import LlamaBlock, LlamaConfig

pytestmark = pytest.mark.inductor


def test_mlp_inference(mlp):
    ref, out, _, cm = run_both(mlp, torch.randn(4, 16), executors=["inductor"])
    torch.testing.assert_close(out, ref)
    assert [r.executor for r in pipeline.regions(cm)] == ["inductor"]


def test_convbn_training_matches_eager_with_running_stats(convbn):
    ref, out, eager, cm = run_both(convbn, torch.randn(4, 3, 8, 8), executors=["inductor"], train=True)
    torch.testing.assert_close(out, ref)
    assert_same_grads(eager, cm, exact=False)
    torch.testing.assert_close(cm.bn.running_mean, eager.bn.running_mean)
    torch.testing.assert_close(cm.bn.running_var, eager.bn.running_var)
    assert int(cm.bn.num_batches_tracked) == 1
    assert {(r.stage, r.executor) for r in pipeline.regions(cm)} == {("forward", "inductor"),
                                                                      ("backward", "inductor")}


def test_llama_block_training_matches_eager():
    block = LlamaBlock(LlamaConfig())
    ref, out, eager, cm = run_both(block, torch.randn(2, 16, 64), executors=["inductor"], train=True)
    torch.testing.assert_close(out, ref)
    assert_same_grads(eager, cm, exact=False, rtol=1e-4, atol=1e-5)


def test_llama_model_training_matches_eager():
    from models import Llama
    model = Llama(LlamaConfig())
    tokens = torch.randint(0, 256, (2, 16))
    ref, out, eager, cm = run_both(model, tokens, executors=["inductor"], train=True)
    torch.testing.assert_close(out, ref)
    assert_same_grads(eager, cm, exact=False, rtol=1e-4, atol=1e-5)


def test_graph_break_function_matches_eager():
    from test_torch_executor import data_dependent
    cf = pipeline.jit(data_dependent, executors=["inductor"])
    x = torch.randn(16).abs() + 0.1
    torch.testing.assert_close(cf(x), data_dependent(x))
    torch.testing.assert_close(cf(-x), data_dependent(-x))
    assert pipeline.compile_stats(cf).graphs >= 2


def test_regions_compile_while_the_kernels_of_earlier_ones_build(mlp, monkeypatch):
    """Inductor's generated module would wait for its kernels as it loads; the executor leaves them to
    Inductor's compile workers while the next regions compile and waits (`finish_region`) once the
    stage's regions are all compiled, before any runs. Kernels still compiling are futures."""
    from concurrent.futures import Future
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import CodeCacheFuture
    from executors.inductor_executor import InductorExecutor

    AsyncCompile.wait_pool_ready()  # until the workers are up, kernels compile in this process
    left_compiling, finish = [], InductorExecutor.finish_region

    def counting_finish(self, fn):
        left_compiling.append(sum(isinstance(v, (Future, CodeCacheFuture)) for _, scope in fn.pending
                                  for v in scope.values()))
        finish(self, fn)
        assert not fn.pending
    monkeypatch.setattr(InductorExecutor, "finish_region", counting_finish)
    ref, out, eager, cm = run_both(mlp, torch.randn(4, 16), executors=["inductor"], train=True)
    torch.testing.assert_close(out, ref)
    assert_same_grads(eager, cm, exact=False)
    assert {(r.stage, r.executor) for r in pipeline.regions(cm)} == {("forward", "inductor"),
                                                                      ("backward", "inductor")}
    assert len(left_compiling) == 2 and all(n > 0 for n in left_compiling), left_compiling


def test_waits_put_off_only_in_this_thread_and_restored_after_a_failed_compile():
    """`kernels_awaited_later` collects the waits of this thread only (another thread's module still
    waits), restores Inductor's own wait when the compile raises, lets a second thread's compile in
    only after the first is done, and stays off where Inductor runs modules while compiling."""
    import threading
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile
    from executors.inductor_kernels import kernels_awaited_later

    original, other_collected, trying = AsyncCompile.wait, [], threading.Event()

    def other_thread():
        AsyncCompile.wait(AsyncCompile(), {})  # Inductor's own wait: nothing to wait for
        trying.set()
        with kernels_awaited_later() as pending:  # blocks until the first thread's compile is done
            AsyncCompile.wait(AsyncCompile(), {"k": 2})
            other_collected.extend(pending)
    with pytest.raises(RuntimeError, match="compile failed"):
        with kernels_awaited_later() as pending:
            AsyncCompile.wait(AsyncCompile(), {"k": 1})
            thread = threading.Thread(target=other_thread)
            thread.start()
            assert trying.wait(10)
            assert [scope for _, scope in pending] == [{"k": 1}]
            raise RuntimeError("compile failed")
    thread.join(10)
    assert [scope for _, scope in other_collected] == [{"k": 2}]
    assert AsyncCompile.wait is original
    with config.patch(max_autotune=True), kernels_awaited_later():
        assert AsyncCompile.wait is original


def test_triton_key_is_hashed_once_per_process_in_a_thread_when_a_gpu_is_there(monkeypatch):
    """A warm start's first kernel launched through `triton.compile` waits for Triton's cache key: it
    is computed in a thread from the first jit on, once."""
    import threading
    from executors import inductor_executor
    from torch._inductor.runtime import triton_compat
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(inductor_executor, "_triton_key_started", [])
    ran = []
    monkeypatch.setattr(triton_compat, "HAS_TRITON", True)
    monkeypatch.setattr(triton_compat, "triton_key", lambda: ran.append(threading.current_thread().name))
    for _ in range(3):
        inductor_executor.InductorExecutor().for_model()
    inductor_executor._triton_key_started[0].result(timeout=10)
    assert len(ran) == 1 and ran[0].startswith("triton_key")
