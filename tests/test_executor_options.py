"""Executor options that are checked without the hardware they need."""
import pytest

import executors


def test_te_fp8_rejects_an_unknown_recipe_and_names_the_supported_ones():
    with pytest.raises(TypeError, match="DelayedScaling.*Float8CurrentScaling"):
        executors.te.fp8("delayed")


def test_te_delayed_scaling_state_is_per_jitted_model():
    class DelayedScaling:  # stands in for transformer_engine.common.recipe.DelayedScaling (not on CPU)
        margin, amax_history_len, amax_compute_algo, scaling_factor_compute_algo = 0, 8, "max", None

    te = executors.te.fp8(DelayedScaling())
    a, b = te.for_model(), te.for_model()
    assert a.scaling is not b.scaling and a.scaling.handle != b.scaling.handle
    assert executors.te.for_model() is executors.te  # bf16: stateless, shared


def test_te_delayed_scaling_rejects_custom_algorithms():
    class DelayedScaling:
        margin, amax_history_len, scaling_factor_compute_algo = 0, 8, None
        amax_compute_algo = staticmethod(lambda history: history.max())

    with pytest.raises(NotImplementedError, match="amax_compute_algo"):
        executors.te.fp8(DelayedScaling()).for_model()
