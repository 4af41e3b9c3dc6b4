"""The data-source protocol: everything the trainer asks of data, and nothing more.

A new kind of data is a new class implementing :class:`DataSource` (describes a data set, hands out this rank's
training :class:`Loader`, batches any subset of its test split) and :class:`Loader` (this rank's batches, in an
order that is a pure function of ``(seed, epoch)`` and the rank; ``iter_from(k)`` resumes at batch ``k``). Both
are ``runtime_checkable`` (members only, not signatures). A batch is what :mod:`mixprec.train.contract` takes,
with its dtypes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from ...errors import UsageError

__all__ = ["Batch", "DataError", "DataSource", "Loader", "TASKS"]

Batch = Any
"""One batch of training or evaluation samples: ``(inputs, targets)``, ``(input_1, ..., input_n, targets)`` or a
dict of tensors (see :mod:`mixprec.train.contract`)."""

TASKS = ("classify", "binary", "multilabel", "regression", "lm")
"""The tasks a data source may name (:mod:`mixprec.train.tasks`); None lets the first batch decide."""


class DataError(UsageError):
    """A dataset cannot be loaded or a loader cannot be built; the message says how to fix it."""


@runtime_checkable
class Loader(Protocol):
    """This rank's training batches of one run, epoch by epoch."""

    @property
    def num_samples(self) -> int:
        """Samples this rank sees per epoch, padding included (the loop derives the last batch's size from it)."""

    def set_epoch(self, epoch: int) -> None:
        """Select the order of ``epoch``; the same ``(seed, epoch)`` gives the same batches. Call it before each
        epoch, or every epoch repeats one order."""

    def iter_from(self, first: int) -> Iterator[Batch]:
        """The epoch's batches from batch ``first`` on (a resumed epoch); the skipped ones are not built."""

    def __iter__(self) -> Iterator[Batch]:
        """The whole epoch: ``iter_from(0)``."""

    def __len__(self) -> int:
        """Batches per epoch on this rank."""


@runtime_checkable
class DataSource(Protocol):
    """One data set: its training and test splits, as the trainer needs them."""

    @property
    def name(self) -> str:
        """What the run reports as its dataset (the ``--dataset`` value, or a description)."""

    @property
    def source(self) -> str:
        """Where the data came from: a folder, a file, a factory, a package."""

    @property
    def task(self) -> str | None:
        """One of :data:`TASKS` when the source knows it, else None (then ``--task`` or
        :func:`mixprec.train.tasks.infer_task`)."""

    @property
    def notes(self) -> tuple[str, ...]:
        """What the source changed in the user's data (float64 inputs trained as float32), said once at the
        start of the run."""

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one sample's inputs, without the batch dimension."""

    @property
    def num_classes(self) -> int:
        """The model's output width the targets imply: classes (``classify``), the vocabulary size (``lm``), the
        number of target values per sample (float or multi-label targets); 0 when unknown."""

    @property
    def n_train(self) -> int:
        """Training samples (text: characters of the training split)."""

    @property
    def n_test(self) -> int:
        """Test samples (text: test windows); 0 for a source without a test split."""

    def loader(self, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1, num_workers: int = 0,
               device: torch.device | None = None) -> Loader:
        """This rank's training batches, shuffled by ``seed``; ``num_workers`` applies to DataLoader sources."""

    def eval_batches(self, indices: torch.Tensor, batch_size: int) -> Iterator[Batch]:
        """The test samples ``indices``, in that order, ``batch_size`` at a time."""
