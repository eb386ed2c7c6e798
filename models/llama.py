"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention through SDPA, SwiGLU."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class LlamaConfig:
    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 128
    max_seq: int = 128
    eps: float = 1e-5
    rope_base: float = 10000.0

    @classmethod
    def llama_1b(cls) -> "LlamaConfig":
        """The ~1B configuration the GPU benchmark trains."""
        return cls(vocab=32000, dim=2048, layers=16, heads=32, kv_heads=8, hidden=5632, max_seq=2048)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq: int, base: float):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotates pairs (x[..., :d/2], x[..., d/2:]) by the position's angle."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.dim // c.heads
        self.wq = nn.Linear(c.dim, c.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.heads * self.head_dim, c.dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos[:s], sin[:s]), apply_rope(k, cos[:s], sin[:s])
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w3 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(c.dim, c.eps), Attention(c)
        self.mlp_norm, self.mlp = RMSNorm(c.dim, c.eps), SwiGLU(c)
        self.config = c
        cos, sin = rope_tables(c.dim // c.heads, c.max_seq, c.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def reset_parameters(self):
        """Recomputes the rotary tables (for a block built on the meta device)."""
        c = self.config
        cos, sin = rope_tables(c.dim // c.heads, c.max_seq, c.rope_base)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x), self.cos, self.sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(LlamaBlock(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim, c.eps)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def next_token_loss(logits, tokens):
    """Cross-entropy of predicting tokens[:, 1:] from logits[:, :-1]."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class LanguageModelLoss(nn.Module):
    """A model and its next-token loss, so a training step's whole graph is compiled. `fp32_loss`:
    the cross-entropy on fp32 logits, as training scripts of bf16 models compute it."""

    def __init__(self, model: nn.Module, fp32_loss: bool = False):
        super().__init__()
        self.model = model
        self.fp32_loss = fp32_loss

    def forward(self, tokens):
        logits = self.model(tokens)
        return next_token_loss(logits.float() if self.fp32_loss else logits, tokens)
