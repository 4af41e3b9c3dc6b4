"""The data sources that are not read from a file: in-memory tensors, the caller's batches, a user's datasets.

Each implements :class:`~mixprec.train.data.protocol.DataSource` (text: :mod:`.text`; built-in datasets:
:mod:`.builtin`). :class:`TensorData` holds tensors (the fast path); :class:`UserBatches` the batches a caller of
:func:`mixprec.doctor.diagnose` passed; :class:`MapData` a user's map-style datasets, batched in exactly
:class:`TensorData`'s order. :func:`user_data` calls a ``--dataset module:callable`` factory and
:func:`data_from_splits` turns its ``(train, test)`` pair into one of them. Dtypes follow
:func:`mixprec.train.contract.normalize_batch` for tensors and datasets alike; the task comes from the first
batch and the model's output (or ``--task``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from ..contract import TARGET_KEYS, as_batch, describe_batch, is_float64, normalize_batch
from ..usercode import UserCodeError, call_declared, load_callable
from .loaders import BatchLoader, FixedBatches, MapLoader, collate, length, on_device, select_batches
from .protocol import Batch, DataError

__all__ = ["TensorData", "UserBatches", "MapData", "user_data", "data_from_splits", "infer_num_classes",
           "output_width"]

IGNORE_INDEX = -100  # tasks.IGNORE_INDEX (not imported: tasks imports torch.nn.functional only for the losses)


@dataclasses.dataclass(frozen=True, eq=False)
class TensorData:
    """A dataset held in memory as tensors (inputs a tensor, tuple or dict; with a dict ``y_*`` is None)."""

    name: str
    x_train: Any = dataclasses.field(repr=False)
    y_train: torch.Tensor | None = dataclasses.field(repr=False)
    x_test: Any = dataclasses.field(repr=False)
    y_test: torch.Tensor | None = dataclasses.field(repr=False)
    num_classes: int
    input_shape: tuple[int, ...]
    source: str
    task: str | None = None
    """classify for the built-in datasets; None (inferred) for a user's tensors."""
    notes: tuple[str, ...] = ()
    resident: bool = False
    """The built-in datasets: ``loader(device=...)`` on an accelerator moves the training split there once
    (:func:`~mixprec.train.data.loaders.on_device`). A user's tensors stay where they are (False)."""
    _moved: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

    @property
    def n_train(self) -> int:
        return length(self.x_train)

    @property
    def n_test(self) -> int:
        return length(self.x_test)

    def loader(self, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1, num_workers: int = 0,
               device: torch.device | None = None) -> BatchLoader:
        """This rank's shuffled training batches (see :class:`BatchLoader`); in memory, so no workers. A
        :attr:`resident` source's batches are indexed on ``device`` (one copy of the split there, kept)."""
        x, y = self.x_train, self.y_train
        if self.resident:
            x, y = on_device((x, y), device, self._moved)
        return BatchLoader(x, y, batch_size, shuffle=True, seed=seed, rank=rank, world_size=world_size)

    def eval_batches(self, indices: torch.Tensor, batch_size: int) -> Iterator[Batch]:
        """Test samples ``indices`` (this rank's evaluation shard), ``batch_size`` at a time."""
        return select_batches(self.x_test, self.y_test, indices, batch_size)


@dataclasses.dataclass(frozen=True, eq=False)
class UserBatches:
    """Batches a user handed over (``mixprec.doctor.diagnose``): trained on as given, in order; no test split."""

    batches: list[Batch] = dataclasses.field(repr=False)
    name: str = "user batch"
    source: str = "the caller's tensors"

    task = None
    n_test = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "batches", [normalize_batch(b) for b in self.batches])

    @property
    def notes(self) -> tuple[str, ...]:
        return ()

    @property
    def n_train(self) -> int:
        return sum(len(as_batch(b)) for b in self.batches)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The first batch's first input without the batch dimension."""
        inputs = as_batch(self.batches[0]).inputs()
        return tuple(inputs[0].shape[1:]) if inputs else ()

    @property
    def num_classes(self) -> int:
        """``max label + 1`` when the targets are non-negative integers, else 0 (they are not class labels)."""
        ys = [as_batch(b).targets for b in self.batches]
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
    task: str | None = None
    notes: tuple[str, ...] = ()

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
        yield from DataLoader(subset, batch_size=batch_size, shuffle=False, collate_fn=collate)


def _is_map_dataset(obj: Any) -> bool:
    return isinstance(obj, TorchDataset) and hasattr(obj, "__getitem__") and hasattr(obj, "__len__")


def _tensor_split(obj: Any) -> tuple[Any, torch.Tensor | None] | None:
    """``(inputs, targets)`` of a split given as tensors: ``(x, y)``, ``(x_1, ..., x_n, y)`` or a dict of
    equal-length tensors with the targets under a target key (returned inside the dict, targets None)."""
    if isinstance(obj, Mapping):
        values = list(obj.values())
        if values and all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in values) \
                and len({len(t) for t in values}) == 1 and any(k in obj for k in TARGET_KEYS):
            return dict(obj), None
        return None
    if isinstance(obj, (tuple, list)) and len(obj) >= 2 and all(isinstance(t, torch.Tensor) and t.dim() > 0
                                                                for t in obj) \
            and len({len(t) for t in obj}) == 1:
        return (obj[0] if len(obj) == 2 else tuple(obj[:-1])), obj[-1]
    return None


def infer_num_classes(labels: Any, what: str) -> int:
    """``max label + 1`` of integer class labels (``-100``, the ignore index, left out); integer labels
    below 0 are refused, naming the targets. 0 for anything that is not a class label."""
    y = torch.as_tensor(labels)
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool or y.dim() != 1:
        return 0
    kept = y[y != IGNORE_INDEX]
    if len(kept) and int(kept.min()) < 0:
        raise DataError(f"{what}: the targets are integer class indices and must be >= 0, found {int(kept.min())} "
                        "(float targets train a regression: give them as float)")
    return int(kept.max()) + 1 if len(kept) else 0


def output_width(targets: torch.Tensor, what: str) -> int:
    """The output width the targets imply (a model factory's ``num_classes``): classes for integer labels,
    else target values per sample."""
    per_sample = targets[0].numel() if targets.dim() > 0 and len(targets) else 1
    if targets.is_floating_point() or targets.is_complex() or targets.dim() == 0:
        return per_sample
    if targets.dim() == 1:
        return infer_num_classes(targets, what)
    kept = targets[targets != IGNORE_INDEX]
    return int(kept.max()) + 1 if len(kept) and int(kept.max()) > 1 else per_sample


def _targets_of(batch: Batch) -> torch.Tensor | None:
    return as_batch(batch).targets


def _labels(ds: TorchDataset) -> torch.Tensor | None:
    """Every target of a dataset (its ``targets`` attribute, else one pass over its samples), with the contract's
    dtypes; None when a sample has none. Float targets stay float (nothing is truncated)."""
    targets = getattr(ds, "targets", None)
    if targets is None:
        targets = []
        for i in range(len(ds)):
            t = _targets_of(ds[i])
            if t is None:
                return None
            targets.append(torch.as_tensor(t))
        targets = torch.stack(targets) if targets else torch.zeros(0, dtype=torch.int64)
    return _targets_of(normalize_batch((torch.zeros(0), torch.as_tensor(targets))))


def user_data(ref: str, *, seed: int) -> TensorData | MapData:
    """Call the ``--dataset module:callable`` factory (it may take ``seed``) and turn its ``(train, test)`` pair
    of Datasets or tensor splits into a data source."""
    flag = "--dataset"
    out = call_declared(load_callable(ref, flag), {"seed": seed}, ref=ref, flag=flag)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise UserCodeError(f"{flag} {ref!r} returned {type(out).__name__}; return (train, test): two "
                            "torch.utils.data.Dataset objects or two (inputs, labels) tensor pairs")
    return data_from_splits(out, ref)


def data_from_splits(splits: Any, ref: str) -> TensorData | MapData:
    """The data source of a ``(train, test)`` pair of datasets or of tensor splits."""
    train, test = splits
    if _tensor_split(train) is not None and _tensor_split(test) is not None:
        return _tensor_data(ref, _tensor_split(train), _tensor_split(test))
    if _is_map_dataset(train) and _is_map_dataset(test):
        return _map_data(ref, train, test)
    raise UserCodeError(f"--dataset {ref!r} gave ({type(train).__name__}, {type(test).__name__}); each split must "
                        "be a map-style torch.utils.data.Dataset, an (inputs, targets) pair of equal-length tensors "
                        "(or (x_1, ..., x_n, targets)), or a dict of equal-length tensors with 'labels'")


def _check_sizes(ref: str, n_train: int, n_test: int) -> None:
    if n_train == 0 or n_test == 0:
        raise DataError(f"--dataset {ref!r}: the {'training' if n_train == 0 else 'test'} split is empty")


def _float64_note(ref: str, x: Any) -> tuple[str, ...]:
    return ((f"--dataset {ref}: float64 inputs are trained as float32 (the model's parameters are float32; "
             "give float32 inputs to skip the conversion)",) if is_float64(x) else ())


def _first_input(x: Any) -> Any:
    """The first input of a sample or a split: the tensor itself, a tuple's first, a dict's first non-target."""
    if isinstance(x, Mapping):
        return next((v for k, v in x.items() if k not in TARGET_KEYS), next(iter(x.values())))
    if isinstance(x, (tuple, list)):
        return x[0]
    return x


def _tensor_data(ref: str, train: tuple[Any, Any], test: tuple[Any, Any]) -> TensorData:
    notes = _float64_note(ref, train[0])
    (x, y), (xt, yt) = (_normalized(*train), _normalized(*test))
    _check_sizes(ref, length(x), length(xt))
    x0, xt0 = _first_input(x), _first_input(xt)
    if x0.shape[1:] != xt0.shape[1:]:
        raise DataError(f"--dataset {ref!r}: train inputs have shape {tuple(x0.shape[1:])} but test inputs "
                        f"{tuple(xt0.shape[1:])}")
    y_all, yt_all = (y if y is not None else _targets_of(x)), (yt if yt is not None else _targets_of(xt))
    n = max(output_width(y_all, f"--dataset {ref!r} (train targets)"),
            output_width(yt_all, f"--dataset {ref!r} (test targets)"))
    return TensorData(name=ref, x_train=x, y_train=y, x_test=xt, y_test=yt, num_classes=n,
                      input_shape=tuple(x0.shape[1:]), source=f"{ref} (tensors)", notes=notes)


def _normalized(x: Any, y: torch.Tensor | None) -> tuple[Any, torch.Tensor | None]:
    if y is None:
        return normalize_batch(x), None
    if isinstance(x, tuple):
        *xs, y = normalize_batch((*x, y))
        return tuple(xs), y
    return tuple(normalize_batch((x, y)))


def _map_data(ref: str, train: TorchDataset, test: TorchDataset) -> MapData:
    _check_sizes(ref, len(train), len(test))
    sample = train[0]
    if not (isinstance(sample, Mapping) or (isinstance(sample, (tuple, list)) and len(sample) >= 2)):
        raise DataError(f"--dataset {ref!r}: a training sample must be an (input, target) pair, an (input_1, ..., "
                        f"input_n, target) tuple or a dict, got {describe_batch(sample)}")
    inputs = sample if isinstance(sample, Mapping) else sample[:-1]
    x0 = torch.as_tensor(_first_input(inputs))
    n = getattr(train, "num_classes", None) or len(getattr(train, "classes", ()) or ())
    if not n:
        widths = [output_width(t, f"--dataset {ref!r} ({what} targets)")
                  for t, what in ((_labels(train), "train"), (_labels(test), "test")) if t is not None]
        n = max(widths, default=0)
    return MapData(train=train, test=test, name=ref, source=f"{ref} ({type(train).__name__})",
                   input_shape=tuple(x0.shape), num_classes=int(n), notes=_float64_note(ref, inputs))
