"""The warning categories and logger (`PIPELINE_LOG=info`: README), in the lowest layer, for every package. Warnings say
what a user must know (something runs slower or otherwise than asked); the logger follows what the compiler does."""

import logging
import os
import sys


class PipelineWarning(UserWarning):
    """Something the user asked for was done differently (a cast while loading a checkpoint, a cache turned off)."""


class PipelineFallbackWarning(PipelineWarning):
    """Part of the model runs in eager PyTorch or on another executor than the listed one: a graph not lowered, a frame
    Dynamo gave up on, a region whose executor failed or was wrong. Counted in `compile_stats(cm).fallbacks`."""


logger = logging.getLogger("pipeline")


def get_logger(name: str) -> logging.Logger:
    """`pipeline.<name>`: a child of the project's logger."""
    return logger.getChild(name)


def _configure_from_env() -> None:
    """`PIPELINE_LOG=info|debug|warning` sends the pipeline's log to stderr at that level."""
    if not (level := os.environ.get("PIPELINE_LOG", "").strip().upper()):
        return
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError(f"PIPELINE_LOG={level.lower()!r}: use debug, info, warning or error")
    if not any(getattr(h, "_pipeline_env", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(name)s %(relativeCreated)8.0fms] %(message)s"))
        handler._pipeline_env = True
        logger.addHandler(handler)
    logger.setLevel(level)


_configure_from_env()
