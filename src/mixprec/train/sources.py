"""Data sources beyond the built-in tensors: the user's own data, and text for language models.

Every source offers what the trainer needs and nothing else (the protocol of
:class:`mixprec.train.data.Dataset`): ``name``, ``source``, ``task`` (``classify`` or ``language-model``),
``input_shape``, ``num_classes``, ``n_train``, ``n_test``, ``loader(batch_size, *, seed, rank, world_size,
num_workers, device)`` and ``eval_batches(indices, batch_size)``.

- **Tensors** (a user callable returning ``((x_train, y_train), (x_test, y_test))``) keep the fast
  in-memory path: they become a :class:`~mixprec.train.data.Dataset` and batches are one ``index_select``.
- **Map-style datasets** (``torch.utils.data.Dataset`` with ``__getitem__``/``__len__``) go through a
  ``DataLoader`` (:class:`MapLoader`): ``--num-workers`` processes, persistent between epochs, pinned memory
  on CUDA, and a ``DistributedSampler`` with explicit rank and seed. That sampler draws
  ``randperm(n, generator seeded seed + epoch)``, pads by wrapping and strides by rank — exactly what
  :class:`~mixprec.train.data.BatchLoader` does for tensors — so the same samples as a Dataset or as
  tensors give the same batches, the same loss curve, and a resumed epoch starts at the right sample
  without loading the skipped batches.
- **Text** (``--dataset text --data-path FILE_OR_DIR``): a character-level corpus
  (:mod:`mixprec.train.text`) with seeded random windows; test loss, perplexity and bits per character.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.data import Dataset as TorchDataset

from .data import DataError, Dataset
from .usercode import UserCodeError, call_declared, load_callable

__all__ = ["MapData", "MapLoader", "user_data", "data_from_splits", "infer_num_classes"]


class _FromSample(DistributedSampler):
    """DistributedSampler that can start an epoch at sample ``start`` (a resumed epoch)."""

    start = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.start:])

    def __len__(self) -> int:
        return super().__len__() - self.start


class MapLoader:
    """Training batches of a map-style dataset: DataLoader + seeded, rank-strided sampler (see module doc)."""

    def __init__(self, dataset: TorchDataset, batch_size: int, *, seed: int, rank: int, world_size: int,
                 num_workers: int, pin_memory: bool) -> None:
        self.batch_size = batch_size
        self.sampler = _FromSample(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, num_workers=num_workers,
                                 pin_memory=pin_memory, persistent_workers=num_workers > 0)
        self._n = math.ceil(self.sampler.num_samples / batch_size)
        self.num_samples = self.sampler.num_samples
        """Samples per epoch on this rank (padding included)."""

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def iter_from(self, first: int) -> Iterator:
        self.sampler.start = first * self.batch_size
        return iter(self.loader)

    def __iter__(self) -> Iterator:
        return self.iter_from(0)

    def __len__(self) -> int:
        return self._n


@dataclasses.dataclass(frozen=True, eq=False)
class MapData:
    """A user's map-style train and test datasets."""

    train: TorchDataset = dataclasses.field(repr=False)
    test: TorchDataset = dataclasses.field(repr=False)
    name: str
    source: str
    input_shape: tuple[int, ...]
    num_classes: int
    task: str = "classify"

    @property
    def n_train(self) -> int:
        return len(self.train)

    @property
    def n_test(self) -> int:
        return len(self.test)

    def loader(self, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1, num_workers: int = 0,
               device: torch.device | None = None) -> MapLoader:
        return MapLoader(self.train, batch_size, seed=seed, rank=rank, world_size=world_size,
                         num_workers=num_workers, pin_memory=device is not None and device.type == "cuda")

    def eval_batches(self, indices: torch.Tensor, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        subset = torch.utils.data.Subset(self.test, indices.tolist())
        yield from DataLoader(subset, batch_size=batch_size, shuffle=False)


def _is_map_dataset(obj: Any) -> bool:
    return isinstance(obj, TorchDataset) and hasattr(obj, "__getitem__") and hasattr(obj, "__len__")


def _is_tensor_pair(obj: Any) -> bool:
    return (isinstance(obj, (tuple, list)) and len(obj) == 2
            and all(isinstance(t, torch.Tensor) for t in obj) and len(obj[0]) == len(obj[1]))


def infer_num_classes(labels: torch.Tensor | Sequence[int], what: str) -> int:
    """``max label + 1`` of integer class labels (negative or non-integer labels are refused)."""
    y = torch.as_tensor(labels)
    if y.is_floating_point() or y.dtype == torch.bool:
        raise DataError(f"{what}: labels must be integer class indices, got {y.dtype}")
    if len(y) and int(y.min()) < 0:
        raise DataError(f"{what}: labels must be >= 0, found {int(y.min())}")
    return int(y.max()) + 1 if len(y) else 0


def _labels(ds: TorchDataset) -> torch.Tensor:
    targets = getattr(ds, "targets", None)
    if targets is not None:
        return torch.as_tensor(targets)
    return torch.as_tensor([int(ds[i][1]) for i in range(len(ds))])  # one pass over the labels


def user_data(ref: str, *, seed: int) -> Dataset | MapData:
    """Call the ``--dataset module:callable`` factory and turn what it returns into a data source.

    The factory returns ``(train, test)``: two map-style ``torch.utils.data.Dataset`` s yielding
    ``(input, label)``, or two ``(inputs, labels)`` tensor pairs. It may take ``seed``.
    """
    flag = "--dataset"
    out = call_declared(load_callable(ref, flag), {"seed": seed}, ref=ref, flag=flag)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise UserCodeError(f"{flag} {ref!r} returned {type(out).__name__}; return (train, test): two "
                            "torch.utils.data.Dataset objects or two (inputs, labels) tensor pairs")
    return data_from_splits(out, ref)


def data_from_splits(splits: Any, ref: str) -> Dataset | MapData:
    """The data source of a ``(train, test)`` pair of datasets or of ``(inputs, labels)`` tensor pairs."""
    train, test = splits
    if _is_tensor_pair(train) and _is_tensor_pair(test):
        return _tensor_data(ref, train, test)
    if _is_map_dataset(train) and _is_map_dataset(test):
        return _map_data(ref, train, test)
    raise UserCodeError(f"--dataset {ref!r} gave ({type(train).__name__}, {type(test).__name__}); each split must "
                        "be a map-style torch.utils.data.Dataset or an (inputs, labels) pair of equal-length tensors")


def _check_sizes(ref: str, n_train: int, n_test: int) -> None:
    if n_train == 0 or n_test == 0:
        raise DataError(f"--dataset {ref!r}: the {'training' if n_train == 0 else 'test'} split is empty")


def _tensor_data(ref: str, train, test) -> Dataset:
    (x, y), (xt, yt) = train, test
    _check_sizes(ref, len(x), len(xt))
    if x.shape[1:] != xt.shape[1:]:
        raise DataError(f"--dataset {ref!r}: train inputs have shape {tuple(x.shape[1:])} but test inputs "
                        f"{tuple(xt.shape[1:])}")
    n = max(infer_num_classes(y, f"--dataset {ref!r} (train)"), infer_num_classes(yt, f"--dataset {ref!r} (test)"))
    return Dataset(name=ref, x_train=x, y_train=y.long(), x_test=xt, y_test=yt.long(), num_classes=n,
                   input_shape=tuple(x.shape[1:]), source=f"{ref} (tensors)")


def _map_data(ref: str, train: TorchDataset, test: TorchDataset) -> MapData:
    _check_sizes(ref, len(train), len(test))
    sample = train[0]
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        raise DataError(f"--dataset {ref!r}: a training sample must be an (input, label) pair, got "
                        f"{type(sample).__name__}")
    x0 = torch.as_tensor(sample[0])
    n = getattr(train, "num_classes", None) or len(getattr(train, "classes", ()) or ()) or max(
        infer_num_classes(_labels(train), f"--dataset {ref!r} (train)"),
        infer_num_classes(_labels(test), f"--dataset {ref!r} (test)"))
    return MapData(train=train, test=test, name=ref, source=f"{ref} ({type(train).__name__})",
                   input_shape=tuple(x0.shape), num_classes=int(n))
