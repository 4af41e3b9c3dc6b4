"""Models for the trainer, chosen to exercise different parts of a mixed-precision policy.

- ``simplenet``: one ``nn.Linear(784, 10)`` (attribute ``fc``);
- ``mlp``: Linear/ReLU stack;
- ``cnn``: two [conv3x3 - BatchNorm - ReLU - maxpool] blocks and a linear head, channels-last;
- ``transformer``: a pre-norm encoder classifier with :class:`~mixprec.train.attention.SelfAttention`, blocks
  written out so autocast sees every op. Images become ``p x p`` patch tokens, ``p`` the largest common divisor
  of H and W ``<= patch_size`` (``model.patch_size``); sequences give one token per position; a CLS token
  feeds the head.

Initialisation uses only the global RNG, so ``torch.manual_seed(s)`` before ``build_model`` fixes it.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..errors import UsageError
from ..validate import positive_int
from .attention import SelfAttention
from .config import ModelConfig

__all__ = ["MODELS", "ModelError", "build_model", "count_parameters"]

MODELS = ("simplenet", "mlp", "cnn", "transformer")


class ModelError(UsageError):
    """A model cannot be built from the given options; the message names the flag to change."""


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()  # Identity: no op at all when disabled


class SimpleNet(nn.Module):
    """The tutorial's model: flatten, then one linear layer."""

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


class MLP(nn.Module):
    def __init__(self, in_features: int, num_classes: int, width: int, depth: int, dropout: float):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(in_features if i == 0 else width, width), nn.ReLU(), _dropout(dropout)]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x.flatten(1)))


class CNN(nn.Module):
    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, channels: int, dropout: float):
        super().__init__()
        c, h, w = input_shape

        def block(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),  # bias is redundant before BatchNorm
                nn.BatchNorm2d(c_out),
                nn.ReLU(),
                nn.MaxPool2d(2),
            )

        self.features = nn.Sequential(block(c, channels), block(channels, 2 * channels))
        self.dropout = _dropout(dropout)
        self.head = nn.Linear(2 * channels * (h // 4) * (w // 4), num_classes)
        # channels-last (NHWC) is what oneDNN's convolutions, batch norm and pooling run fastest on the CPU,
        # bf16 most of all (benchmarks/README.md). Weights are stored NHWC here; inputs are made NHWC in forward.
        self.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous(memory_format=torch.channels_last)
        return self.head(self.dropout(self.features(x).flatten(1)))


class Block(nn.Module):
    """Pre-norm encoder block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, dropout=dropout)
        self.drop1 = _dropout(dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d_model, d_model)
        self.drop2 = _dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.fc2(self.act(self.fc1(self.ln2(x)))))


class Transformer(nn.Module):
    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        d_model: int,
        n_heads: int,
        n_layers: int,
        patch_size: int,
        dropout: float,
    ):
        super().__init__()
        self.input_shape = tuple(input_shape)
        if len(input_shape) == 3:
            c, h, w = input_shape
            self.patch_size = max(p for p in range(1, min(patch_size, h, w) + 1) if h % p == 0 and w % p == 0)
            n_tokens, token_dim = (h // self.patch_size) * (w // self.patch_size), c * self.patch_size**2
        elif len(input_shape) == 2:
            self.patch_size = None
            n_tokens, token_dim = input_shape
        else:
            self.patch_size = None
            n_tokens, token_dim = input_shape[0], 1
        self.embed = nn.Linear(token_dim, d_model)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Parameter(torch.zeros(1, n_tokens + 1, d_model))
        # trunc_normal_(std=0.02)'s values (its bounds, +-2, are 100 std away) without its host read (mask.any()),
        # which fake tensors cannot answer: mixprec plan builds this model under fake tensors
        nn.init.normal_(self.cls, std=0.02)
        nn.init.normal_(self.pos, std=0.02)
        self.drop = _dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(B, *input_shape) -> (B, T, token_dim)."""
        if x.ndim == 4:  # (B, C, H, W) -> (B, H/p * W/p, C*p*p)
            b, c, h, w = x.shape
            p = self.patch_size
            x = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
            return x.reshape(b, (h // p) * (w // p), c * p * p)
        if x.ndim == 2:  # (B, L) -> (B, L, 1)
            return x.unsqueeze(-1)
        return x  # (B, L, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(self.tokens(x))
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x[:, 0]))


def _check_positive(**sizes: int) -> None:
    for flag, value in sizes.items():
        positive_int(flag, value, error=ModelError)


def build_model(
    model: ModelConfig | str,
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    dropout: float = 0.0,
    **sizes: int,
) -> nn.Module:
    """Build a classifier taking ``(B, *input_shape)`` float inputs and returning ``(B, num_classes)`` logits.

    ``model`` is the config's model section or a built-in name, with ``sizes`` overriding
    :class:`ModelConfig`'s. Only the chosen model's options are checked. Raises ModelError naming the flag.
    """
    config = model if isinstance(model, ModelConfig) else ModelConfig(name=model)
    config = dataclasses.replace(config, **sizes) if sizes else config
    name = config.name
    if name not in MODELS:
        raise ModelError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")
    input_shape = tuple(int(d) for d in input_shape)
    if not input_shape or any(d < 1 for d in input_shape):
        raise ModelError(f"{name}: input_shape {input_shape} must be a non-empty tuple of positive sizes")
    if num_classes < 1:
        raise ModelError(f"{name}: num_classes {num_classes} must be >= 1")
    if not 0.0 <= dropout < 1.0:
        raise ModelError(f"--dropout {dropout} must be in [0, 1)")
    options = dict(width=config.width, depth=config.depth, channels=config.channels, d_model=config.d_model,
                   n_heads=config.n_heads, n_layers=config.n_layers, patch_size=config.patch_size, dropout=dropout)
    return _BUILDERS[name](input_shape, num_classes, **options)


def _simplenet(input_shape, num_classes, **_) -> nn.Module:
    return SimpleNet(math.prod(input_shape), num_classes)


def _mlp(input_shape, num_classes, *, width, depth, dropout, **_) -> nn.Module:
    _check_positive(width=width, depth=depth)
    return MLP(math.prod(input_shape), num_classes, width, depth, dropout)


def _cnn(input_shape, num_classes, *, channels, dropout, **_) -> nn.Module:
    _check_positive(channels=channels)
    if len(input_shape) != 3:
        raise ModelError(
            f"cnn needs image inputs (C, H, W), got input shape {input_shape}; "
            "use --model mlp or --model transformer for this data"
        )
    if input_shape[1] < 4 or input_shape[2] < 4:
        raise ModelError(
            f"cnn pools twice by 2, so images must be at least 4x4, got {input_shape[1]}x{input_shape[2]}; "
            "use --model mlp or --model transformer for this data"
        )
    return CNN(input_shape, num_classes, channels, dropout)


def _transformer(input_shape, num_classes, *, d_model, n_heads, n_layers, patch_size, dropout, **_) -> nn.Module:
    _check_positive(d_model=d_model, n_heads=n_heads, n_layers=n_layers, patch_size=patch_size)
    if d_model % n_heads != 0:
        raise ModelError(
            f"--d-model {d_model} must be divisible by --n-heads {n_heads} "
            f"(each head gets d_model / n_heads features); e.g. --n-heads {math.gcd(d_model, n_heads)}"
        )
    if len(input_shape) > 3:
        raise ModelError(
            f"transformer takes (L,), (L, D) or image (C, H, W) inputs, got input shape {input_shape}; "
            "use --model mlp for this data"
        )
    return Transformer(input_shape, num_classes, d_model, n_heads, n_layers, patch_size, dropout)


_BUILDERS = {"simplenet": _simplenet, "mlp": _mlp, "cnn": _cnn, "transformer": _transformer}


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements; a parameter shared between modules is counted once."""
    return sum(p.numel() for p in model.parameters())
