"""With `te` listed, what lies between TE's linears compiles on Inductor: checked on the CPU with
TE's GEMM replaced by a matmul stand-in (`te_on_cpu` in conftest.py; TE itself needs a GPU), forward
and backward against eager."""
import pytest

import pipeline
from helpers import assert_llama_step_matches_eager
from models import LlamaConfig

pytestmark = pytest.mark.inductor


def test_regions_between_te_linears_compile_on_inductor(te_on_cpu):
    """Every non-linear region of a Llama and its loss runs on Inductor, none falls back, and the
    second layer reuses the first layer's compiled regions.
    Before elements of multi-output ops stayed with their op, each attention region returned the
    attention's whole output tuple (its logsumexp is saved for the backward) and the loss region
    took it in: Inductor failed on both and they ran op by op on torch (10 ms a step on the H200)."""
    config = LlamaConfig(vocab=512, dim=128, layers=2, heads=4, kv_heads=2, hidden=256, max_seq=32)
    cm = assert_llama_step_matches_eager(config, [te_on_cpu, "inductor"])

    table = pipeline.regions(cm)
    assert {r.executor for r in table} == {"te", "inductor"}, str(table)
    assert not [r.fallback_reason for r in table if r.fallback_reason], str(table)
    assert sum(r.executor == "te" for r in table) == 2 * 9  # 2 x (qkv, wo, w1+w3, w2) + head; forward, backward
    # the second layer's regions run the code compiled for the first layer's
    twins = [r for r in table if r.compiled_as is not None and r.executor == "inductor"]
    assert len(twins) >= 6, str([(r.id, r.compiled_as) for r in table])
    # each norm's weight gradient is summed in its layer's region, not all of them in the last one
    last_backward = [r for r in table if r.stage == "backward"][-1]
    assert last_backward.ops.count("sum") <= 2, last_backward.ops  # the first norm's weight and input
