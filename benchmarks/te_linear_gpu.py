"""Where the time of one TE linear goes, on the GPU: casts, GEMMs, the whole forward and backward of
`pipeline_te::linear`, against torch's bf16 linear. Shapes of the ~1B Llama at batch 4 x seq 2048.

    python benchmarks/te_linear_gpu.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from executors.te_scaling import DelayedScalingState, current_quantizer  # noqa: E402
import executors.te_executor  # noqa: E402,F401  (registers the ops)
from cuda_timing import cuda_ms as ms  # noqa: E402


def main():
    from transformer_engine.common.recipe import DelayedScaling
    from transformer_engine.pytorch.cpp_extensions import general_gemm
    ops = torch.ops.pipeline_te
    delayed = DelayedScalingState(DelayedScaling())
    index = delayed.register("w")
    print(f"{'M x K x N':>20} {'what':<36} {'ms':>7} {'TFLOP/s':>8}")
    for m, k, n in [(8192, 2048, 5632), (8192, 5632, 2048), (8192, 2048, 2048), (8192, 2048, 32000)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        flops = 2 * m * k * n
        qx, qw = current_quantizer("e4m3"), current_quantizer("e4m3")
        xq, wq = qx(x), qw(w)
        dq, dw_ = delayed.forward_quantizers(index, x.device)
        saved_cur = ops.linear(x, w, None, True, -1, 0)[1:]
        saved_del = ops.linear(x, w, None, True, delayed.handle, index)[1:]
        rows = [
            ("torch bf16 linear", lambda: torch.nn.functional.linear(x, w), flops),
            ("te bf16 linear (fwd op)", lambda: ops.linear(x, w, None, False, -1, 0), flops),
            ("te bf16 linear_backward", lambda: ops.linear_backward(dy, [x, w], False, False, -1, 0), 2 * flops),
            ("cast x current (row+col)", lambda: qx(x), 0),
            ("cast W current (row+col)", lambda: qw(w), 0),
            ("cast x delayed (row+col)", lambda: dq(x), 0),
            ("cast W delayed (row+col)", lambda: dw_(w), 0),
            ("fp8 gemm on cast operands", lambda: general_gemm(wq, xq, out_dtype=torch.bfloat16, layout="TN",
                                                                use_split_accumulator=False), flops),
            ("te fp8 current: fwd op", lambda: ops.linear(x, w, None, True, -1, 0), flops),
            ("te fp8 delayed: fwd op", lambda: ops.linear(x, w, None, True, delayed.handle, index), flops),
            ("te fp8 current: backward op", lambda: ops.linear_backward(dy, list(saved_cur), False, True, -1, 0), 2 * flops),
            ("te fp8 delayed: backward op", lambda: ops.linear_backward(dy, list(saved_del), False, True,
                                                                        delayed.handle, index), 2 * flops),
        ]
        for what, fn, f in rows:
            t = ms(fn)
            rate = f"{f / t / 1e9:8.0f}" if f else ""
            print(f"{f'{m}x{k}x{n}':>20} {what:<36} {t:7.3f} {rate}", flush=True)


if __name__ == "__main__":
    main()
