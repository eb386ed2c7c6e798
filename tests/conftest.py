import os
import sys
import types

import pytest
import torch
import torch.nn as nn
import torch._dynamo


STAND_INS = os.path.join(os.path.dirname(__file__), "gpu_library_stand_ins")
STAND_IN_FOR = {"te": "transformer_engine", "nvfuser": "nvfuser_direct"}  # folder -> the library it stands in for
_stand_ins_used: list[str] = []


def pytest_addoption(parser):
    parser.addoption("--gpu-library-stand-ins", action="store_true",
                     help="import Transformer Engine and nvFuser stand-ins that raise when called (each where the "
                          "real one is absent): CPU tests then run as on the GPU machine "
                          "(tests/gpu_library_stand_ins/README.md)")


def pytest_configure(config):
    import importlib.util
    if not config.getoption("--gpu-library-stand-ins"):
        return
    for folder, module in STAND_IN_FOR.items():
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin in (None, "namespace"):  # absent, or an empty namespace folder
            sys.path.insert(0, os.path.join(STAND_INS, folder))
            _stand_ins_used.append(module)
    if _stand_ins_used:
        sys.path.insert(0, os.path.join(STAND_INS, "common"))


def pytest_report_header(config):
    if config.getoption("--gpu-library-stand-ins"):
        return f"gpu library stand-ins (raise when called): {', '.join(_stand_ins_used) or 'none: the real ones are installed'}"


def pytest_collection_modifyitems(config, items):
    # a fallback to eager (or to another executor) is an error in tests, except where a test
    # is about fallbacks and says so with @pytest.mark.allow_fallback
    for item in items:
        if "allow_fallback" in item.keywords:
            item.add_marker(pytest.mark.filterwarnings("default::ir.diagnostics.PipelineFallbackWarning"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu.sh tests on the GPU machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def every_call_compiled(request, monkeypatch):
    """A test passes only if every jitted model it called compiled something: at least one graph,
    none of them run in eager. Eager fallback gives eager's numbers, so comparing with eager alone
    cannot tell a working compiler from one that compiles nothing."""
    import importlib
    jit_module = importlib.import_module("pipeline.jit")  # the module (`pipeline.jit` is the function)
    states = []
    init = jit_module.CompileState.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        states.append(self)
    monkeypatch.setattr(jit_module.CompileState, "__init__", recording_init)
    yield
    if "allow_fallback" in request.keywords:
        return
    for state in states:
        history = state.history
        if history.calls == 0 or (state.config.fallback == "raise" and history.fallbacks):  # it raised to the test
            continue
        assert history.records, (f"a jitted model was called {history.calls} time(s) and compiled no graph "
                                 f"(it ran uncompiled); fallbacks: {history.fallbacks}")
        eager = {r.graph_id: r.eager_fallback for r in history.records if r.eager_fallback}
        assert not eager, f"graphs ran in eager: {eager}"
        assert not history.fallbacks, f"fallbacks: {history.fallbacks}"


@pytest.fixture(autouse=True, scope="session")
def session_pipeline_cache(tmp_path_factory):
    """The compiled-artifact cache never writes to the user's home dir during tests (this covers
    module-scoped fixtures, set up before the per-test folder below)."""
    saved = {k: os.environ.get(k) for k in ("PIPELINE_CACHE_DIR", "PIPELINE_CACHE")}
    os.environ["PIPELINE_CACHE_DIR"] = str(tmp_path_factory.mktemp("pipeline_cache"))
    os.environ.pop("PIPELINE_CACHE", None)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def private_pipeline_cache(tmp_path, monkeypatch):
    """The compiled-artifact cache of each test is its own empty folder."""
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path / "pipeline_cache"))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: Dynamo's caches are keyed on code objects that tests share."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


class MLP(nn.Module):
    def __init__(self, d_in=16, d_hidden=32, d_out=8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, d_hidden), nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(y.mean(dim=(2, 3)))


@pytest.fixture
def mlp():
    return MLP()


@pytest.fixture
def convbn():
    return ConvBN()


# Stand-ins for the GPU executors, to test on the CPU what they do to the graph (claims, regions,
# numerics of everything around their kernels).

def general_gemm(A, B, out_dtype=None, layout="TN", bias=None, grad=False, **kwargs):
    """TE's `general_gemm` in cuBLAS's column-major convention: D = op(A) op(B) read column-major,
    i.e. op(B) @ op(A) row-major; with `grad` the bias slot returns the bias gradient."""
    a = A.t() if layout[0] == "T" else A
    b = B.t() if layout[1] == "T" else B
    out = b.float() @ a.float()
    bias_grad = None
    if bias is not None and not grad:
        out = out + bias.float()
    elif bias is not None:
        bias_grad = b.float().sum(1).to(out_dtype)  # over the contracted dim: one per row of the output
    return out.to(out_dtype), bias_grad, None, None


@pytest.fixture
def te_on_cpu(monkeypatch):
    """The te executor (bf16, grouped linears) with TE's GEMM replaced by `general_gemm` above."""
    from executors.te_executor import TEExecutor
    gemm = types.ModuleType("transformer_engine.pytorch.cpp_extensions")
    gemm.general_gemm = general_gemm
    for name in ("transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, gemm.__name__, gemm)
    monkeypatch.setattr(TEExecutor, "unavailable_reason", lambda self: None)
    monkeypatch.setattr(TEExecutor, "_reject", lambda self, node: None)
    return TEExecutor().options(group_linears=True)


@pytest.fixture
def nvfuser_claims_on_cpu(monkeypatch):
    """The nvfuser executor claiming what it claims on a GPU, its fusions replaced by the region's
    ATen graph (everything else, from the claims to the runner, is nvFuser's own code)."""
    from executors import nvfuser_executor
    from executors.nvfuser_executor import NvFuserExecutor, _EagerFusion
    monkeypatch.setattr(NvFuserExecutor, "device", "cpu")
    monkeypatch.setattr(NvFuserExecutor, "unavailable_reason", lambda self: None)
    monkeypatch.setattr(nvfuser_executor, "_build", lambda gm, inputs: _EagerFusion(gm))
    return NvFuserExecutor()
