"""Applying a per-tensor cast to a call's arguments, last argument first: torch's C++ autocast kernels cast in
a parameter-pack expansion GCC evaluates right to left, and matching it keeps the autograd graph's node order
(and the backward op sequence) identical to torch's. The arguments are copied only when a cast replaced one."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["F32", "map_args", "map_tensors", "iter_tensors"]

F32 = torch.float32
_Tensor = torch.Tensor
_SEQUENCES = (list, tuple)

Cast = Callable[[torch.Tensor], torch.Tensor]


def _map_seq(seq: list | tuple, fn: Cast) -> list | tuple:
    return type(seq)([fn(x) if isinstance(x, _Tensor) else x for x in seq])


def map_args(args: tuple, fn: Cast) -> tuple:
    """``args`` with ``fn`` applied to every tensor (one level into lists and tuples), last first."""
    new_args = None
    i = len(args)
    while i:
        i -= 1
        a = args[i]
        if isinstance(a, _Tensor):
            b = fn(a)
        elif type(a) in _SEQUENCES and a:
            b = _map_seq(a, fn)
        else:
            continue
        if b is not a:
            if new_args is None:
                new_args = list(args)
            new_args[i] = b
    return args if new_args is None else tuple(new_args)


def map_tensors(args: tuple, kwargs: dict, fn: Cast) -> tuple[tuple, dict]:
    """Apply ``fn`` to every tensor in args/kwargs: keywords (last first), then positionals."""
    if kwargs:
        new_kwargs = None
        for k in reversed(kwargs):
            v = kwargs[k]
            if isinstance(v, _Tensor):
                w = fn(v)
            elif type(v) in _SEQUENCES and v:
                w = _map_seq(v, fn)
            else:
                continue
            if w is not v:
                if new_kwargs is None:
                    new_kwargs = dict(kwargs)  # same keys, same order
                new_kwargs[k] = w
        if new_kwargs is not None:
            kwargs = new_kwargs
    return map_args(args, fn), kwargs


def iter_tensors(args: tuple, kwargs: dict) -> Iterable[torch.Tensor]:
    """Every tensor in args/kwargs, looking one level into lists and tuples."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, _Tensor):
            yield a
        elif type(a) in _SEQUENCES:
            for x in a:
                if isinstance(x, _Tensor):
                    yield x
