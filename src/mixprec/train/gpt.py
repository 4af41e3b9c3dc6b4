"""A small GPT: the decoder-only transformer language model, shaped like nanoGPT / GPT-2.

``GPT(vocab_size, block_size, n_layers=, n_heads=, d_model=)`` maps token ids ``(B, T)``, ``T <= block_size``,
to next-token logits ``(B, T, vocab_size)``:

    x = wte[idx] + wpe[0..T-1]                          token + learned position embeddings
    for each block:
        x = x + proj(attention(qkv(ln1(x))))            causal self-attention, pre-norm
        x = x + down(gelu(up(ln2(x))))                  MLP, 4 * d_model hidden features
    logits = ln_f(x) @ wte.T                            head weight-tied to the token embedding

Initialisation follows nanoGPT, from the global RNG only. With ``d_model`` a multiple of 16 every block Linear
is FP8-convertible; the tied ``head`` is kept out of FP8 by the default filter.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attention

from .models import ModelError

__all__ = ["GPT", "lm_loss"]

INIT_STD = 0.02  # GPT-2 / nanoGPT


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: fused qkv projection, SDPA with ``is_causal=True``, output proj."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = _dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads): heads become a batch dimension for SDPA
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = attention(q, k, v, causal=True, dropout_p=self.dropout if self.training else 0.0)  # fast kernel
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # heads side by side again
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """d_model -> 4 d_model -> GELU -> d_model. Named ``up``/``down``: ``fc`` would be kept out of FP8."""

    def __init__(self, d_model: int, dropout: float):
        super().__init__()
        self.up = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * d_model, d_model)
        self.drop = _dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(self.act(self.up(x))))


class GPTBlock(nn.Module):
    """Pre-norm decoder block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _check_sizes(vocab_size, block_size, n_layers, n_heads, d_model, dropout) -> None:
    sizes = {"vocab_size": vocab_size, "block_size": block_size, "n_layers": n_layers, "n_heads": n_heads,
             "d_model": d_model}
    for flag, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelError(f"gpt: --{flag.replace('_', '-')} {value!r} must be a positive integer")
    if d_model % n_heads:
        raise ModelError(
            f"gpt: --d-model {d_model} must be divisible by --n-heads {n_heads} "
            f"(each head gets d_model / n_heads features); e.g. --n-heads {math.gcd(d_model, n_heads)}"
        )
    if not 0.0 <= dropout < 1.0:
        raise ModelError(f"gpt: --dropout {dropout} must be in [0, 1)")


class GPT(nn.Module):
    """Decoder-only transformer language model (see the module docstring). Raises ModelError for bad sizes,
    and at forward time for input that is not ``(B, T)`` with ``T <= block_size``."""

    def __init__(self, vocab_size: int, block_size: int, *, n_layers: int, n_heads: int, d_model: int,
                 dropout: float = 0.0):
        super().__init__()
        _check_sizes(vocab_size, block_size, n_layers, n_heads, d_model, dropout)
        self.vocab_size, self.block_size = vocab_size, block_size
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.drop = _dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.wte.weight  # weight tying: one Parameter, used twice
        self._init_weights(n_layers)

    def _init_weights(self, n_layers: int) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = INIT_STD / math.sqrt(2 * n_layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.down.weight, mean=0.0, std=residual_std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.ndim != 2:
            raise ModelError(f"gpt takes token ids of shape (batch, time), got shape {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.block_size:
            raise ModelError(
                f"gpt: sequence length {t} is longer than block_size {self.block_size} (the number of learned "
                f"positions); feed at most {self.block_size} tokens or build the model with block_size >= {t}"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats per token) of ``logits`` (B, T, V) against ``targets`` (B, T),
    computed in fp32 whatever the logits' dtype (low-precision-parameter recipes have no autocast to do it)."""
    if logits.ndim != 3 or targets.shape != logits.shape[:2]:
        raise ModelError(
            f"lm_loss takes logits (B, T, V) and targets (B, T), got {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
