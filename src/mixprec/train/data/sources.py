"""The data sources that are not read from a file: in-memory tensors, the caller's batches, a user's datasets.

Each implements :class:`~mixprec.train.data.protocol.DataSource`; text lives in :mod:`.text`, the built-in
datasets (which load into :class:`TensorData`) in :mod:`.builtin`.

- :class:`TensorData`: a dataset held in memory as tensors, the fast path: the built-in datasets, and a user
  callable returning ``((x_train, y_train), (x_test, y_test))``. Batches are one ``index_select``
  (:class:`~mixprec.train.data.loaders.BatchLoader`).
- :class:`UserBatches`: the batches a caller of :func:`mixprec.doctor.diagnose` passed, trained on in the given
  order; no test split.
- :class:`MapData`: a user's map-style datasets (``torch.utils.data.Dataset`` with ``__getitem__``/``__len__``),
  through a ``DataLoader`` (:class:`~mixprec.train.data.loaders.MapLoader`) whose seeded, rank-strided sampler
  gives exactly :class:`~mixprec.train.data.loaders.BatchLoader`'s order: the same samples as a dataset or as
  tensors give the same batches, the same loss curve, and a resumed epoch starts at the right sample without
  loading the skipped batches.

:func:`user_data` calls a ``--dataset module:callable`` factory; :func:`data_from_splits` turns the
``(train, test)`` pair it returns (or that the Python API was given) into a :class:`TensorData` or a
:class:`MapData`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from ..usercode import UserCodeError, call_declared, load_callable
from .loaders import BatchLoader, FixedBatches, MapLoader, select_batches
from .protocol import Batch, DataError

__all__ = ["TensorData", "UserBatches", "MapData", "user_data", "data_from_splits", "infer_num_classes"]


@dataclasses.dataclass(frozen=True, eq=False)
class TensorData:
    """A classification dataset held in memory as tensors. ``eq=False``: compared by identity, not by tensors."""

    name: str
    x_train: torch.Tensor = dataclasses.field(repr=False)  # float32, (N, *input_shape)
    y_train: torch.Tensor = dataclasses.field(repr=False)  # int64, (N,)
    x_test: torch.Tensor = dataclasses.field(repr=False)
    y_test: torch.Tensor = dataclasses.field(repr=False)
    num_classes: int
    input_shape: tuple[int, ...]
    source: str

    task = "classify"

    @property
    def n_train(self) -> int:
        return len(self.x_train)

    @property
    def n_test(self) -> int:
        return len(self.x_test)

    def loader(self, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1, num_workers: int = 0,
               device: torch.device | None = None) -> BatchLoader:
        """This rank's shuffled training batches (see :class:`BatchLoader`); in memory, so no workers."""
        return BatchLoader(self.x_train, self.y_train, batch_size, shuffle=True, seed=seed, rank=rank,
                           world_size=world_size)

    def eval_batches(self, indices: torch.Tensor, batch_size: int) -> Iterator[Batch]:
        """Test samples ``indices`` (this rank's evaluation shard), ``batch_size`` at a time."""
        return select_batches(self.x_test, self.y_test, indices, batch_size)


@dataclasses.dataclass(frozen=True, eq=False)
class UserBatches:
    """Batches a user handed over (``mixprec.doctor.diagnose``): trained on in the given order, no test split.

    The batch size of the config does not apply (each batch is as given). The targets need not be class labels
    (the caller brings the model and the loss), so nothing is shaped from :attr:`num_classes`.
    """

    batches: list[Batch] = dataclasses.field(repr=False)
    name: str = "user batch"
    source: str = "the caller's tensors"

    task = "classify"
    n_test = 0

    @property
    def n_train(self) -> int:
        return sum(len(y) for _, y in self.batches)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The first batch's inputs without the batch dimension."""
        return tuple(self.batches[0][0].shape[1:])

    @property
    def num_classes(self) -> int:
        """``max label + 1`` when the targets are non-negative integers, else 0 (they are not class labels)."""
        ys = [y for _, y in self.batches]
        if not all(isinstance(y, torch.Tensor) and not (y.is_floating_point() or y.is_complex()
                                                        or y.dtype == torch.bool) for y in ys):
            return 0
        ys = [y for y in ys if y.numel()]
        if not ys or min(int(y.min()) for y in ys) < 0:
            return 0
        return max(int(y.max()) for y in ys) + 1

    def loader(self, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1, num_workers: int = 0,
               device: torch.device | None = None) -> FixedBatches:
        """The given batches, the same order every epoch."""
        return FixedBatches(self.batches)

    def eval_batches(self, indices: torch.Tensor, batch_size: int) -> Iterator[Batch]:
        """Nothing: there is no test split."""
        return iter(())


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

    def eval_batches(self, indices: torch.Tensor, batch_size: int) -> Iterator[Batch]:
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


def user_data(ref: str, *, seed: int) -> TensorData | MapData:
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


def data_from_splits(splits: Any, ref: str) -> TensorData | MapData:
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


def _tensor_data(ref: str, train, test) -> TensorData:
    (x, y), (xt, yt) = train, test
    _check_sizes(ref, len(x), len(xt))
    if x.shape[1:] != xt.shape[1:]:
        raise DataError(f"--dataset {ref!r}: train inputs have shape {tuple(x.shape[1:])} but test inputs "
                        f"{tuple(xt.shape[1:])}")
    n = max(infer_num_classes(y, f"--dataset {ref!r} (train)"), infer_num_classes(yt, f"--dataset {ref!r} (test)"))
    return TensorData(name=ref, x_train=x, y_train=y.long(), x_test=xt, y_test=yt.long(), num_classes=n,
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
