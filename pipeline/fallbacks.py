"""Loud fallbacks: every time part of a model runs otherwise than compiled as asked, one `PipelineFallbackWarning`,
a line in `compile_stats(cm).fallbacks` and the log; with `jit(..., fallback="raise")` a `PipelineFallbackError`
(docs/design.md, "Invariants"). Not an error by default: a model should train when one graph does not compile."""

import warnings

from ir import PipelineFallbackWarning, get_logger

MODES = ("warn", "raise")
log = get_logger("fallback")


class PipelineFallbackError(RuntimeError):
    """`fallback="raise"` and part of the model would have run uncompiled; names what and why."""


def report_fallback(state, message: str, cause: BaseException | None = None) -> None:
    state.history.fallbacks.append(message)
    log.info("fallback: %s", message)
    if state.config.fallback == "raise":
        raise PipelineFallbackError(f"pipeline (fallback='raise'): {message}") from cause
    warnings.warn(f"pipeline: {message}", PipelineFallbackWarning, stacklevel=2)
