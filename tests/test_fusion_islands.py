"""With two fusion executors listed, a fusible island is not split between them: checked on the CPU
with nvFuser's claims (`nvfuser_claims_on_cpu` in conftest.py: its kernels replaced by the region's
ATen graph; nvFuser itself needs a GPU)."""
import pytest
import torch

import pipeline
from helpers import assert_llama_step_matches_eager, values_passed_between_regions
from models import LlamaConfig

pytestmark = pytest.mark.inductor


def test_no_fp32_logits_sized_value_crosses_regions_with_nvfuser_listed(nvfuser_claims_on_cpu):
    """nvFuser takes no slice, scatter or NLL, so by op alone the fp32 loss tail alternated between
    nvFuser and Inductor regions, and each boundary wrote a logits-sized fp32 buffer (three alive at
    once on the H200: +2.8 GiB over Inductor alone). As an island it goes whole to Inductor."""
    config = LlamaConfig(vocab=1024, dim=64, layers=1, heads=4, kv_heads=2, hidden=128, max_seq=16)
    cm = assert_llama_step_matches_eager(config, [nvfuser_claims_on_cpu, "inductor"])

    table = pipeline.regions(cm)
    assert {"nvfuser", "inductor"} <= {r.executor for r in table}, str(table)
    passed = values_passed_between_regions(cm)
    logits_fp32 = [v for v in passed if v.dtype == torch.float32 and v.dim() and v.shape[-1] == config.vocab]
    assert not logits_fp32, f"{[tuple(v.shape) for v in logits_fp32]}\n{table}"
    assert any("joined inductor's" in (r.fallback_reason or "") for r in table), str(table)


def test_te_nvfuser_inductor_on_the_cpu_matches_eager(te_on_cpu, nvfuser_claims_on_cpu):
    """The issue's executor list, [te, nvfuser, inductor], end to end on the CPU (TE's GEMM replaced by
    a matmul, nvFuser's kernels by the region's graph): two layers, so the second runs the first's
    compiled regions; every region on its executor (no compile fallback) and loss and gradients as
    eager's."""
    config = LlamaConfig(vocab=1024, dim=64, layers=2, heads=4, kv_heads=2, hidden=128, max_seq=16)
    cm = assert_llama_step_matches_eager(config, [te_on_cpu, nvfuser_claims_on_cpu, "inductor"])

    table = pipeline.regions(cm)
    assert {"te", "nvfuser", "inductor"} <= {r.executor for r in table}, str(table)
    assert not [r.id for r in table if "failed to compile" in (r.fallback_reason or "")], str(table)
    assert any(r.compiled_as is not None for r in table if r.executor == "nvfuser")


def test_nvfuser_leaves_regions_of_only_views_to_eager_with_the_reason(nvfuser_claims_on_cpu):
    """A region of views only (weight transposes between TE's or Inductor's regions) computes
    nothing: nvFuser declines it (a fusion's launch costs more than eager's views) and says why."""
    config = LlamaConfig(vocab=256, dim=64, layers=1, heads=4, kv_heads=2, hidden=128, max_seq=16)
    cm = assert_llama_step_matches_eager(config, [nvfuser_claims_on_cpu, "inductor"])
    table = pipeline.regions(cm)
    views_only = [r for r in table if all(op in ("t", "view", "transpose", "alias", "_unsafe_view", "permute")
                                          for op in r.ops)]
    assert views_only, str(table)
    for r in views_only:
        assert r.executor == "torch" and "nvfuser declined: nothing to compute" in r.fallback_reason, str(table)
    assert any(r.executor == "nvfuser" for r in table), str(table)
