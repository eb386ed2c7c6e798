"""`Region`: a group of ops of one trace that one executor runs."""

import dataclasses
from typing import Optional


@dataclasses.dataclass
class Region:
    """A region of a trace, assigned to an executor. Printed as one row of `pipeline.regions`."""
    id: int
    stage: str                    # inference | forward | backward
    executor: str
    ops: list[str]                # op names, in order
    input_shapes: list[str]
    output_shapes: list[str]
    graph_id: str = ""            # which captured graph the region belongs to
    fallback_reason: Optional[str] = None  # why a listed executor did not run it, if one was skipped
    compile_seconds: float = 0.0
    compiled_as: Optional[int] = None  # an identical earlier region whose compiled code this one runs
    gemm_flops: int = 0           # matmul FLOPs per call
    fp8_gemm_flops: int = 0       # of which in fp8
    race: Optional[dict] = None   # autotune: median ms of each candidate executor (the choice: `executor`)

    @property
    def op_count(self) -> int:
        return len(self.ops)
