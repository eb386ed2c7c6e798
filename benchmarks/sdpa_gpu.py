"""Causal attention forward + backward on the GPU, per SDPA backend, at the training benchmark's shape
(batch 4, 32 heads, seq 2048, head dim 64, bf16): which kernel should run the model's attention.
With fewer key/value heads (grouped-query attention, the model's 8), also each backend given the
grouped k/v directly (`enable_gqa=True`) against repeating them to every head first, as the model
does (the repeat and, in the backward, its sum included); and both given the causal mask as a tensor,
as a traced Hugging Face model does (transformers' `sdpa_mask`), with SDPA choosing its backend
("SDPA's choice"): what `causal_attention` saves. Then Transformer Engine's fused attention and
FlashAttention-4 (`flash_attn.cute`, CuTe-DSL kernels compiled at the first call), when they import,
each given the grouped k/v directly.

    python benchmarks/sdpa_gpu.py [--batch 4 --heads 32 --kv-heads 8 --seq 2048 --head-dim 64]
"""
import argparse
import contextlib
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuda_timing import cuda_ms as time_ms

BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    a = p.parse_args()
    shape = (a.batch, a.heads, a.seq, a.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    # causal: half of the 4·b·h·s²·d forward FLOPs; backward 2.5× the forward
    fwd_flops = 4 * a.batch * a.heads * a.seq ** 2 * a.head_dim / 2
    print(f"SDPA causal {shape} bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    ref = None
    for backend in BACKENDS:
        result = measure(backend, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), dy,
                         forward_too=True)
        if isinstance(result, str):
            print(f"  {backend.name:20} unavailable: {result}")
            continue
        ref = ref or result
        _, _, fwd, both = result
        print(f"  {backend.name:20} fwd {fwd:6.3f} ms ({fwd_flops / fwd / 1e9:5.0f} TFLOP/s)   "
              f"fwd+bwd {both:6.3f} ms ({3.5 * fwd_flops / both / 1e9:5.0f} TFLOP/s)   "
              f"max |Δ| vs flash {max_difference(result, ref):.2e}")
    if a.kv_heads < a.heads:
        grouped_query_attention(a, fwd_flops)
    transformer_engine_attention(a, fwd_flops)
    flash_attention_4(a, fwd_flops)


def measure(backend, fn, inputs, dy, forward_too=False):
    """(output, input gradients, forward ms or None, forward+backward ms) of `fn` on one SDPA
    backend, or why the backend cannot run it."""
    try:
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a backend's reasons for declining, one per call
            out = fn()
            grads = torch.autograd.grad(out, inputs, dy)
            fwd = time_ms(fn) if forward_too else None
            both = time_ms(lambda: torch.autograd.grad(fn(), inputs, dy))
    except Exception as e:  # SDPA declining (RuntimeError), or a kernel that does not compile or launch here
        return str(e).splitlines()[0][:120] if str(e) else type(e).__name__
    return out, grads, fwd, both


def max_difference(result, ref) -> float:
    """The largest difference between two measured results' outputs and gradients."""
    return max((x.float() - y.float()).abs().max().item()
               for x, y in zip((result[0], *result[1]), (ref[0], *ref[1])))


def grouped_query_attention(a, fwd_flops):
    repeat = a.heads // a.kv_heads
    q = torch.randn(a.batch, a.heads, a.seq, a.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(a.batch, a.kv_heads, a.seq, a.head_dim, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    dy = torch.randn_like(q)

    def repeated():
        return F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, dim=1),
                                              v.repeat_interleave(repeat, dim=1), is_causal=True)

    def grouped():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    mask = torch.ones(a.seq, a.seq, device="cuda", dtype=torch.bool).tril().expand(a.batch, 1, a.seq, a.seq)

    def repeated_masked():  # a traced HF model: repeat_kv, the causal mask as a tensor
        return F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, dim=1),
                                              v.repeat_interleave(repeat, dim=1), attn_mask=mask)

    def grouped_masked():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    print(f"grouped-query: {a.kv_heads} k/v heads for {a.heads} query heads")
    ref = None
    variants = [("k/v repeated", repeated), ("enable_gqa", grouped), ("repeated+mask", repeated_masked),
                ("gqa+mask", grouped_masked)]
    for backend in [*BACKENDS, None]:
        for name, fn in variants:
            label = backend.name if backend is not None else "SDPA's choice"
            result = measure(backend, fn, (q, k, v), dy)
            if isinstance(result, str):
                print(f"  {label:20} {name:13} unavailable: {result}")
                continue
            ref = ref or result
            both = result[3]
            print(f"  {label:20} {name:13} fwd+bwd {both:6.3f} ms ({3.5 * fwd_flops / both / 1e9:5.0f} "
                  f"TFLOP/s)   max |Δ| vs the first {max_difference(result, ref):.2e}")


def transformer_engine_attention(a, fwd_flops):
    """TE's DotProductAttention (its cuDNN fused attention: flash-attn is turned off), grouped k/v given
    directly, [b, s, h, d]."""
    import os
    os.environ.setdefault("NVTE_FLASH_ATTN", "0")  # TE's cuDNN fused attention, not flash-attn if installed
    try:
        import transformer_engine.pytorch as te
    except Exception as e:  # absent, or failing to load (a missing library, another torch)
        print(f"  transformer_engine    unavailable: {e}")
        return
    q, k, v = bshd_inputs(a)
    attn = te.DotProductAttention(a.heads, a.head_dim, num_gqa_groups=a.kv_heads, qkv_format="bshd",
                                  attn_mask_type="causal")
    dy = torch.randn(a.batch, a.seq, a.heads * a.head_dim, device="cuda", dtype=torch.bfloat16)
    fwd = time_ms(lambda: attn(q, k, v))
    both = time_ms(lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), dy))
    print(f"  transformer_engine    grouped k/v   fwd {fwd:6.3f} ms ({fwd_flops / fwd / 1e9:5.0f} TFLOP/s)   "
          f"fwd+bwd {both:6.3f} ms ({3.5 * fwd_flops / both / 1e9:5.0f} TFLOP/s)")


def bshd_inputs(a):
    """q, and grouped k and v, laid out [batch, seq, heads, head dim] as TE and FlashAttention take them."""
    return [torch.randn(a.batch, a.seq, heads, a.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for heads in (a.heads, a.kv_heads, a.kv_heads)]


def flash_attention_4(a, fwd_flops):
    """FlashAttention-4 (its Hopper kernels on an H100/H200), grouped k/v given directly, [b, s, h, d];
    checked against SDPA's math on the same inputs. `scripts/fa4_bundle.sh` brings it to the GPU machine."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:
        print(f"  flash_attn.cute (FA4) unavailable: {e}")
        return
    q, k, v = bshd_inputs(a)
    dy = torch.randn_like(q)

    def fa4():
        out = flash_attn_func(q, k, v, causal=True)
        return out[0] if isinstance(out, tuple) else out  # (out, log-sum-exp) in some versions

    start = time.perf_counter()
    result = measure(None, fa4, (q, k, v), dy, forward_too=True)
    if isinstance(result, str):
        print(f"  flash_attn.cute (FA4) unavailable: {result}")
        return
    first = time.perf_counter() - start
    with sdpa_kernel(SDPBackend.MATH):  # SDPA on [b, h, s, d], grouped k/v
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True,
                                             enable_gqa=True).transpose(1, 2)
        ref = (out, torch.autograd.grad(out, (q, k, v), dy))
    _, _, fwd, both = result
    print(f"  flash_attn.cute (FA4) grouped k/v   fwd {fwd:6.3f} ms ({fwd_flops / fwd / 1e9:5.0f} TFLOP/s)   "
          f"fwd+bwd {both:6.3f} ms ({3.5 * fwd_flops / both / 1e9:5.0f} TFLOP/s)   "
          f"max |Δ| vs SDPA math {max_difference(result, ref):.2e}   (compiling and timing {first:.0f} s)")


if __name__ == "__main__":
    main()
