"""What an fp8 cast costs beside the kernel that makes its input, on the GPU: the TE executor's way
(Inductor writes the bf16 tensor, TE's delayed-scaling quantizer reads it and writes fp8 and the amax)
against the cast written in the graph (Inductor fuses the cast and the amax into the producer and
writes only fp8), for the tensors a Llama layer casts: the RMSNorm output (q/k/v and gate/up input),
the SwiGLU output (down_proj's input) and a gradient cast with its transpose (the wgrad GEMM's operand).

    python3 benchmarks/fp8_cast_fusion_gpu.py [--tokens 8192] [--dim 2048] [--ffn 5632]

Prints the median ms of each way per tensor, and the total over 16 layers.
"""

import argparse

import torch
import torch.nn.functional as F

from cuda_timing import cuda_median_ms

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def rmsnorm(x, w):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w


def swiglu(g, u):
    return F.silu(g) * u


def grad_of_swiglu(dy, g, u):  # d(silu(g) * u)/du * dy: a pointwise producer of a gradient
    return dy * F.silu(g)


AMAX = {"whole tensor": lambda t: t.abs().amax().float(),
        "by rows": lambda t: t.abs().amax(-1).amax().float(),  # a row reduction, then over the rows
        "none": None}


def cast(t, scale, dtype, transposed: bool, amax: str):
    """The fp8 cast in plain torch ops (delayed scaling: the scale is known before the call), and
    the amax delayed scaling records for the next steps' scales, taken as `AMAX[amax]` says."""
    limit = torch.finfo(dtype).max
    q = (t.float() * scale).clamp(-limit, limit).to(dtype)
    out = (q, q.t().contiguous()) if transposed else (q,)
    return (*out, AMAX[amax](t)) if AMAX[amax] else out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    args = p.parse_args()
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer
    import transformer_engine_torch as tex  # importable once transformer_engine.pytorch is

    torch._dynamo.config.recompile_limit = 64  # one lambda compiled for every case and variant
    dev, bf16 = "cuda", torch.bfloat16
    m, d, f = args.tokens, args.dim, args.ffn
    x, w = torch.randn(m, d, device=dev, dtype=bf16), torch.ones(d, device=dev, dtype=bf16)
    g, u, dy = (torch.randn(m, f, device=dev, dtype=bf16) for _ in range(3))
    scale, amax = torch.ones(1, device=dev), torch.zeros(1, device=dev)

    def te_way(producer, fmt, columnwise):
        q = Float8Quantizer(scale, amax, fmt, rowwise=True, columnwise=columnwise)
        made = torch.compile(producer)
        return lambda *a: q(made(*a))

    def graph_way(producer, dtype, transposed, amax):
        return torch.compile(lambda *a: cast(producer(*a), scale, dtype, transposed, amax))

    cases = [("rmsnorm -> e4m3", rmsnorm, (x, w), tex.DType.kFloat8E4M3, E4M3, False, 2),
             ("swiglu -> e4m3", swiglu, (g, u), tex.DType.kFloat8E4M3, E4M3, False, 1),
             ("gradient -> e5m2 + transpose", grad_of_swiglu, (dy, g, u), tex.DType.kFloat8E5M2, E5M2, True, 1)]
    total_te = total_graph = 0.0
    for name, producer, inputs, te_fmt, dtype, transposed, per_layer in cases:
        timed = lambda fn: cuda_median_ms(fn, *inputs, warmup=5, reps=50)  # noqa: E731
        alone, te_ms = timed(torch.compile(producer)), timed(te_way(producer, te_fmt, transposed))
        in_graph = {amax: timed(graph_way(producer, dtype, transposed, amax)) for amax in AMAX}
        total_te += per_layer * te_ms
        total_graph += per_layer * in_graph["whole tensor"]
        ways = ", ".join(f"amax {amax} {ms:.3f} ms" for amax, ms in in_graph.items())
        print(f"{name:32s} producer alone {alone:.3f} ms | + TE cast {te_ms:.3f} ms | cast in the graph: "
              f"{ways} (x{per_layer} per layer)")
    print(f"16 layers: TE casts {16 * total_te:.2f} ms, casts in the graph {16 * total_graph:.2f} ms")


if __name__ == "__main__":
    main()
