"""The loaders: every :class:`~mixprec.train.data.protocol.Loader` a data source hands out, and the batching of
in-memory test sets.

Guarantee: the order of an epoch is a pure function of ``(seed, epoch)``, identical on every rank; rank ``r`` of
``world_size`` takes positions ``r, r + world_size, ...``. :class:`BatchLoader` (tensors) and :class:`MapLoader`
(a map-style dataset over a ``DistributedSampler``) give the same batches for the same samples;
:class:`TextWindowLoader` draws random windows of a token sequence; :class:`FixedBatches` keeps a caller's order.
``iter_from(k)`` starts an epoch at batch ``k`` without building the skipped batches, so a resumed run sees the
batches the interrupted run would have seen. Every batch tensor is contiguous (:func:`contiguous`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, default_collate
from torch.utils.data import Dataset as TorchDataset

from ...validate import positive_int
from ..contract import as_batch, normalize_batch
from .protocol import Batch, DataError

__all__ = ["BatchLoader", "FixedBatches", "MapLoader", "TextWindowLoader", "select_batches", "assemble", "collate",
           "contiguous", "length", "on_device"]


def _check_rank(owner: str, rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"{owner}: rank={rank} must satisfy 0 <= rank < world_size={world_size}")


# ------------------------------------------------------------------------------------------ in memory
# In-memory inputs are a tensor, a tuple of tensors (several inputs) or a dict of tensors (targets inside it,
# y None); every tensor's first dimension is the sample.


def length(x: Any) -> int:
    """Samples in in-memory inputs (a tensor, a tuple or a dict of tensors)."""
    if isinstance(x, torch.Tensor):
        return x.shape[0]
    return length(next(iter(x.values() if isinstance(x, dict) else x)))


def _device(x: Any) -> torch.device:
    return x.device if isinstance(x, torch.Tensor) else _device(next(iter(x.values() if isinstance(x, dict) else x)))


def _to(x: Any, device: torch.device) -> Any:
    if x is None or isinstance(x, torch.Tensor):
        return x if x is None else x.to(device)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return tuple(_to(v, device) for v in x)


def on_device(x: Any, device: torch.device | None, cache: dict) -> Any:
    """``x`` on an accelerator ``device``, copied once and kept in ``cache``; on the CPU ``x`` itself."""
    if device is None or torch.device(device).type == "cpu":
        return x
    key = str(device)
    if key not in cache:
        cache[key] = _to(x, torch.device(device))
    return cache[key]


def _take(x: Any, idx: torch.Tensor) -> Any:
    if isinstance(x, torch.Tensor):
        return x.index_select(0, idx.to(x.device))
    if isinstance(x, dict):
        return {k: _take(v, idx) for k, v in x.items()}
    return tuple(_take(v, idx) for v in x)


def _rows(x: Any, a: int, b: int) -> Any:
    if isinstance(x, torch.Tensor):
        return x[a:b]
    if isinstance(x, dict):
        return {k: v[a:b] for k, v in x.items()}
    return tuple(v[a:b] for v in x)


def contiguous(batch: Any) -> Any:
    """``batch`` with every tensor in it contiguous (a tensor, or a tuple, list or dict of them; other items as
    they are). A contiguous tensor is returned itself, not copied."""
    if isinstance(batch, torch.Tensor):
        return batch.contiguous()
    if isinstance(batch, Mapping):
        return {k: contiguous(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(contiguous(v) for v in batch)
    return batch


def assemble(xb: Any, yb: torch.Tensor | None) -> Batch:
    """One batch in the contract's shape: ``(x, y)``, ``(x_1, ..., x_n, y)``, or the dict itself; contiguous."""
    if yb is None:
        return contiguous(xb)
    return contiguous((*xb, yb) if isinstance(xb, tuple) else (xb, yb))


class BatchLoader:
    """In-memory batches by index slicing, in ``DistributedSampler``'s order (permutation seeded ``seed + epoch``,
    padded by wrapping, strided by rank), on the device of ``x``. Call ``set_epoch(epoch)`` before each epoch.
    """

    def __init__(
        self,
        x: Any,
        y: torch.Tensor | None,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int = 0,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ):
        if y is not None and length(x) != y.shape[0]:
            raise DataError(f"BatchLoader: x has {length(x)} samples but y has {y.shape[0]}")
        positive_int("batch_size", batch_size, error=DataError)
        _check_rank("BatchLoader", rank, world_size)
        self.x, self.y = x, y
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.num_samples = math.ceil(length(x) / world_size)  # per rank, padding included

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation for ``epoch``; the same ``(seed, epoch)`` gives the same order."""
        self.epoch = epoch

    def _indices(self) -> torch.Tensor | None:
        """This rank's sample indices for the current epoch, or None for 'all, in order'."""
        n = length(self.x)
        if not self.shuffle and self.world_size == 1:
            return None
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g)
        else:
            order = torch.arange(n)
        total = self.num_samples * self.world_size
        if total > n:  # wrap around (repeatedly if world_size > n) so every rank gets num_samples
            order = order.repeat(math.ceil(total / n))[:total]
        return order[self.rank : total : self.world_size].to(_device(self.x))

    def __iter__(self) -> Iterator[Batch]:
        return self._batches(0)

    def _batches(self, first: int) -> Iterator[Batch]:
        if length(self.x) == 0:
            return
        indices = self._indices()
        b = self.batch_size
        y = self.y
        for i in range(first, len(self)):
            if indices is None:
                yield assemble(_rows(self.x, i * b, (i + 1) * b), None if y is None else y[i * b : (i + 1) * b])
            else:
                idx = indices[i * b : (i + 1) * b]
                yield assemble(_take(self.x, idx), None if y is None else y.index_select(0, idx.to(y.device)))

    def iter_from(self, first: int) -> Iterator[Batch]:
        """The epoch's batches from batch ``first`` on (a resumed epoch; the skipped ones are not built)."""
        return self._batches(first)

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)


def select_batches(x: Any, y: torch.Tensor | None, indices: torch.Tensor,
                   batch_size: int) -> Iterator[Batch]:
    """``(x[idx], y[idx])`` for consecutive ``batch_size`` slices of ``indices``: in-memory evaluation batches."""
    for i in range(0, len(indices), batch_size):
        idx = indices[i:i + batch_size]
        yield assemble(_take(x, idx), None if y is None else y.index_select(0, idx.to(y.device)))


class FixedBatches(list):
    """Given batches with the loader interface: the same order every epoch, each made contiguous once."""

    def __init__(self, batches=()):
        super().__init__(contiguous(b) for b in batches)

    def set_epoch(self, epoch: int) -> None:
        pass

    def iter_from(self, first: int) -> Iterator[Batch]:
        return iter(self[first:])

    @property
    def num_samples(self) -> int:
        return sum(len(as_batch(b)) for b in self)


# ------------------------------------------------------------------------------------ map-style datasets


class _FromSample(DistributedSampler):
    """DistributedSampler that can start an epoch at sample ``start`` (a resumed epoch)."""

    start = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.start:])

    def __len__(self) -> int:
        return super().__len__() - self.start


def collate(samples: list[Any]) -> Batch:
    """``default_collate``, then the contract's dtypes (:func:`~mixprec.train.contract.normalize_batch`),
    contiguous. Module level, so DataLoader workers can pickle it."""
    return contiguous(normalize_batch(default_collate(samples)))


class MapLoader:
    """Training batches of a map-style dataset: DataLoader + seeded, rank-strided sampler (see module doc)."""

    def __init__(self, dataset: TorchDataset, batch_size: int, *, seed: int, rank: int, world_size: int,
                 num_workers: int, pin_memory: bool) -> None:
        self.batch_size = batch_size
        self.sampler = _FromSample(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, num_workers=num_workers,
                                 pin_memory=pin_memory, persistent_workers=num_workers > 0, collate_fn=collate)
        self._n = math.ceil(self.sampler.num_samples / batch_size)
        self.num_samples = self.sampler.num_samples
        """Samples per epoch on this rank (padding included)."""

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def iter_from(self, first: int) -> Iterator[Batch]:
        self.sampler.start = first * self.batch_size
        return iter(self.loader)

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_from(0)

    def __len__(self) -> int:
        return self._n


# ---------------------------------------------------------------------------------------------- text


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed that is a pure function of ``(seed, epoch)``, distinct for distinct pairs."""
    state = np.random.SeedSequence([seed % 2**64, epoch % 2**64]).generate_state(1, dtype=np.uint64)
    return int(state[0]) >> 1


class TextWindowLoader:
    """Seeded random windows of a token sequence: ``x = tokens[i : i+T]``, ``y = tokens[i+1 : i+T+1]``, int64 on
    the device of ``tokens``; one global batch drawn per step from ``(seed, epoch)``, strided by rank.
    ``steps_per_epoch`` defaults to about one pass over the sequence. Call ``set_epoch(epoch)`` before each epoch.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, batch_size: int, *, seed: int = 0,
                 steps_per_epoch: int | None = None, rank: int = 0, world_size: int = 1):
        positive_int("block_size", block_size, error=DataError)
        positive_int("batch_size", batch_size, error=DataError)
        positive_int("steps_per_epoch", steps_per_epoch, allow_none=True, error=DataError)
        if tokens.ndim != 1:
            raise DataError(f"TextWindowLoader: tokens must be one sequence (1-D), got shape {tuple(tokens.shape)}")
        if len(tokens) < block_size + 1:
            raise DataError(
                f"TextWindowLoader: {len(tokens)} tokens cannot hold one window of block_size + 1 = "
                f"{block_size + 1}; use --block-size {max(len(tokens) - 1, 1)} or less, or more text"
            )
        _check_rank("TextWindowLoader", rank, world_size)
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch = 0
        self.n_starts = len(tokens) - block_size  # valid starts 0 .. N-T-1: y needs tokens[i+T]
        if steps_per_epoch is None:
            steps_per_epoch = max(1, self.n_starts // (batch_size * block_size * world_size))
        self.steps_per_epoch = steps_per_epoch
        self._offsets = torch.arange(block_size + 1, device=tokens.device)

    def set_epoch(self, epoch: int) -> None:
        """Select the windows of ``epoch``; the same ``(seed, epoch)`` gives the same batches."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_from(0)

    def iter_from(self, first: int) -> Iterator[Batch]:
        """The epoch's batches from batch ``first`` on; the skipped ones' positions are drawn, not gathered. The
        epoch's positions are drawn on the host at its start and reach the tokens' device in one copy."""
        g = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
        global_batch = self.world_size * self.batch_size
        starts = [torch.randint(0, self.n_starts, (global_batch,), generator=g) for _ in range(self.steps_per_epoch)]
        if first >= self.steps_per_epoch:
            return
        mine = torch.stack(starts[first:])[:, self.rank :: self.world_size].to(self.tokens.device)
        for positions in mine:
            windows = self.tokens[positions[:, None] + self._offsets]  # (B, T + 1), the tokens' dtype
            yield (windows[:, :-1].to(torch.int64, memory_format=torch.contiguous_format),
                   windows[:, 1:].to(torch.int64, memory_format=torch.contiguous_format))

    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def num_samples(self) -> int:
        """Windows per epoch on this rank (every batch is full)."""
        return self.steps_per_epoch * self.batch_size
