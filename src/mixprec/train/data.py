"""Datasets and the in-memory batch loader. Nothing is ever downloaded.

Every dataset is small enough to live in memory as two tensors, so there is no per-sample
``Dataset.__getitem__`` and no worker processes: a batch is one ``index_select`` on a tensor.

- ``fashion-mnist`` / ``mnist``: the four IDX files (``train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each raw or
  ``.gz``) from ``data_dir``; Fashion-MNIST falls back to the Debian package ``dataset-fashion-mnist``
  (``FASHION_MNIST_DIR``). Images become float32 ``(N, 1, 28, 28)`` normalised exactly as the tutorial's
  ``ToTensor()`` + ``Normalize((0.5,), (0.5,))``: ``(x / 255 - 0.5) / 0.5``, so values lie in [-1, 1].
- ``digits``: scikit-learn's embedded 8x8 digits (1,797 images), ``(x / 16 - 0.5) / 0.5``, split 80/20
  stratified by class with a fixed seed (``DIGITS_SPLIT_SEED``) that does not depend on the training
  seed, so every run evaluates on the same test set.
- ``synthetic``: a Gaussian mixture, one fixed random mean pattern per class plus unit noise. The means
  are scaled so the distance between two class means is ``4 * sqrt(2)`` noise standard deviations
  whatever the input size: a linear model can learn it (Bayes error about 2% with 10 classes), but not
  in zero steps, so accuracy above chance means the training worked.

``BatchLoader`` shuffles with a permutation that is a pure function of ``(seed, epoch)`` (like
``torch.utils.data.DistributedSampler``: ``torch.Generator().manual_seed(seed + epoch)``), so every rank
draws the same permutation and takes a disjoint strided shard of it.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import UsageError

__all__ = [
    "DATASETS",
    "FASHION_MNIST_DIR",
    "BatchLoader",
    "DataError",
    "IdxFormatError",
    "Dataset",
    "load_dataset",
    "read_idx",
]

DATASETS = ("fashion-mnist", "mnist", "digits", "synthetic")
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # Debian package dataset-fashion-mnist
DIGITS_SPLIT_SEED = 0  # fixed: the digits test set is the same for every training seed
DIGITS_TEST_FRACTION = 0.2
SYNTHETIC_SEPARATION = 4.0  # class-mean distance / sqrt(2), in noise standard deviations

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
_IDX_MAGIC = {0x00000801: "labels", 0x00000803: "images"}  # uint8 vectors and uint8 3-D arrays
# Where torchvision's FashionMNIST(root=DIR) / MNIST(root=DIR) puts the raw files, also searched.
_TORCHVISION_SUBDIR = {"fashion-mnist": os.path.join("FashionMNIST", "raw"), "mnist": os.path.join("MNIST", "raw")}


class DataError(UsageError):
    """A dataset cannot be loaded or a loader cannot be built; the message says how to fix it."""


class IdxFormatError(DataError):
    """A file that was read but is not a well-formed IDX file (bad gzip, magic, header or payload size).

    Only these are called corrupt (fixed by getting the files again); a file that cannot be *read*
    (permission denied, a folder in its place) is a plain :class:`DataError` that says so.
    """


@dataclass(frozen=True, eq=False)
class Dataset:
    """A classification dataset held in memory. ``eq=False``: compared by identity, not by tensors."""

    name: str
    x_train: torch.Tensor = field(repr=False)  # float32, (N, *input_shape)
    y_train: torch.Tensor = field(repr=False)  # int64, (N,)
    x_test: torch.Tensor = field(repr=False)
    y_test: torch.Tensor = field(repr=False)
    num_classes: int
    input_shape: tuple[int, ...]
    source: str

    @property
    def n_train(self) -> int:
        return len(self.x_train)

    @property
    def n_test(self) -> int:
        return len(self.x_test)

    task = "classify"
    """``classify`` (logits (B, C), accuracy) or ``language-model`` (logits (B, T, V), perplexity, bits/char)."""

    def loader(self, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1, **_: Any) -> BatchLoader:
        """This rank's shuffled training batches (see :class:`BatchLoader`)."""
        return BatchLoader(self.x_train, self.y_train, batch_size, shuffle=True, seed=seed, rank=rank,
                           world_size=world_size)

    def eval_batches(self, indices: torch.Tensor, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Test samples ``indices`` (this rank's evaluation shard), ``batch_size`` at a time."""
        return select_batches(self.x_test, self.y_test, indices, batch_size)


def select_batches(x: torch.Tensor, y: torch.Tensor, indices: torch.Tensor,
                   batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(x[idx], y[idx])`` for consecutive ``batch_size`` slices of ``indices``: in-memory evaluation batches."""
    for i in range(0, len(indices), batch_size):
        idx = indices[i:i + batch_size]
        yield x.index_select(0, idx.to(x.device)), y.index_select(0, idx.to(y.device))


@dataclass(frozen=True, eq=False)
class UserBatches:
    """Batches a user handed over (``mixprec.doctor.diagnose``): trained on in the given order, no test split.

    The same data-source interface as :class:`Dataset` (``name``, ``source``, ``n_train``, ``loader``), so the
    one build path takes it; the batch size of the config does not apply (each batch is as given).
    """

    batches: list[tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    name: str = "user batch"
    source: str = "the caller's tensors"

    @property
    def n_train(self) -> int:
        return sum(len(y) for _, y in self.batches)

    n_test = 0
    task = "classify"

    def loader(self, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1, **_: Any) -> FixedBatches:
        return FixedBatches(self.batches)


class FixedBatches(list):
    """Given batches with the loader interface: the same order every epoch."""

    def set_epoch(self, epoch: int) -> None:
        pass

    def iter_from(self, first: int):
        return iter(self[first:])

    @property
    def num_samples(self) -> int:
        return sum(len(y) for _, y in self)


# --------------------------------------------------------------------------------------------- IDX


def read_idx(path) -> torch.Tensor:
    """Read an IDX file (raw or gzip-compressed, detected from its first bytes) into a uint8 tensor.

    Accepts the two formats of MNIST-style datasets: magic ``0x00000803`` (uint8 images, 3 dims) and
    ``0x00000801`` (uint8 labels, 1 dim). The payload must be exactly ``prod(dims)`` bytes.

    A well-formed file may hold no samples (first dimension 0): it reads as an empty tensor, and the
    dataset loader refuses an empty split with a message naming the file.

    Raises:
        DataError: the file is missing or cannot be read (permission denied, a folder). The message names
            the file and says which.
        IdxFormatError: the file is not gzip-decodable, has another magic number, or its payload is
            truncated or has trailing bytes.
    """
    path = os.fspath(path)
    data = _read_bytes(path)
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise IdxFormatError(f"{path}: corrupt gzip data ({e})") from None
    if len(data) < 4:
        raise IdxFormatError(f"{path}: too short to be an IDX file ({len(data)} bytes)")
    magic = int.from_bytes(data[:4], "big")
    if magic not in _IDX_MAGIC:
        raise IdxFormatError(
            f"{path}: not an IDX file of uint8 images or labels (magic 0x{magic:08x}; "
            "expected 0x00000803 for images or 0x00000801 for labels)"
        )
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(data) < header:
        raise IdxFormatError(f"{path}: IDX header truncated ({len(data)} bytes, header needs {header})")
    dims = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = header + math.prod(dims)
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "has trailing bytes"
        raise IdxFormatError(
            f"{path}: IDX payload {what}: header says {_IDX_MAGIC[magic]} of shape {dims}, "
            f"so the file should be {expected} bytes, but it is {len(data)}"
        )
    if expected == header:  # a well-formed file of no samples (torch.frombuffer refuses count=0)
        return torch.empty(dims, dtype=torch.uint8)
    # bytearray makes the buffer writable (torch.frombuffer warns on read-only bytes); one memcpy.
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=header, count=expected - header)
    return flat.reshape(dims)


def _read_bytes(path: str) -> bytes:
    """The file's bytes; a DataError that says why not (missing, permission denied, a folder)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except PermissionError:
        raise DataError(f"{path}: permission denied: this user cannot read the file; fix its permissions "
                        f"(e.g. chmod a+r {path}) or copy the files to a folder you can read") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a folder, not an IDX file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None


def _how_to_get(name: str) -> str:
    files = ", ".join(f"{f}[.gz]" for f in IDX_FILES.values())
    if name == "fashion-mnist":
        return (
            "Install the data with `apt-get install dataset-fashion-mnist` (files go to "
            f"{FASHION_MNIST_DIR}), or pass --data-dir DIR with the four IDX files ({files})."
        )
    return f"Pass --data-dir DIR with the four MNIST IDX files ({files})."


def _find_idx_dir(name: str, data_dir: str | None) -> str:
    if data_dir is None:
        if name == "mnist":
            raise DataError(f"dataset 'mnist' needs --data-dir: mixprec does not download data. {_how_to_get(name)}")
        data_dir = FASHION_MNIST_DIR
    data_dir = os.path.expanduser(data_dir)
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise DataError(f"{name}: --data-dir {data_dir} is a file, not a folder; pass the folder that holds "
                        f"the IDX files. {_how_to_get(name)}")
    if not os.path.isdir(data_dir):
        raise DataError(f"{name}: data directory {data_dir} does not exist. {_how_to_get(name)}")
    if not os.access(data_dir, os.R_OK | os.X_OK):  # else every file in it would read as "not found"
        raise DataError(f"{name}: data directory {data_dir}: permission denied: this user cannot list it; "
                        f"fix its permissions (e.g. chmod a+rx {data_dir}) or copy the files elsewhere")
    nested = os.path.join(data_dir, _TORCHVISION_SUBDIR[name])
    if not _idx_path(data_dir, IDX_FILES["train_images"]) and _idx_path(nested, IDX_FILES["train_images"]):
        return nested
    return data_dir


def _idx_path(directory: str, stem: str) -> str | None:
    """The uncompressed file if present (no decompression needed), else the .gz one, else None."""
    for candidate in (stem, stem + ".gz"):
        path = os.path.join(directory, candidate)
        if os.path.isfile(path):
            return path
    return None


def _read_split(name: str, directory: str, images: str, labels: str) -> tuple[torch.Tensor, torch.Tensor]:
    arrays = []
    for stem, ndim in ((IDX_FILES[images], 3), (IDX_FILES[labels], 1)):
        path = _idx_path(directory, stem)
        if path is None:
            raise DataError(f"{name}: {os.path.join(directory, stem)}[.gz] not found. {_how_to_get(name)}")
        try:
            array = read_idx(path)
        except IdxFormatError as e:
            raise DataError(f"{name}: {e}. The file is corrupt; {_how_to_get(name)}") from None
        except DataError as e:
            raise DataError(f"{name}: {e}") from None
        kind = "images" if ndim == 3 else "labels"
        if array.ndim != ndim:
            raise DataError(f"{name}: {path} holds {array.ndim}-D data, expected {kind}. {_how_to_get(name)}")
        if array.shape[0] == 0:
            raise DataError(f"{name}: {path} is a valid IDX file of {kind} but holds no samples (shape "
                            f"{tuple(array.shape)}); nothing to train or test on. {_how_to_get(name)}")
        arrays.append((path, array))
    (image_path, x), (label_path, y) = arrays
    if tuple(x.shape[1:]) != (28, 28):
        raise DataError(f"{name}: {image_path} has images of shape {tuple(x.shape[1:])}, expected (28, 28)")
    if x.shape[0] != y.shape[0]:
        raise DataError(
            f"{name}: {image_path} has {x.shape[0]} images but {label_path} has {y.shape[0]} labels; "
            f"the files do not belong together. {_how_to_get(name)}"
        )
    if y.numel() and int(y.max()) >= 10:
        raise DataError(f"{name}: {label_path} has label {int(y.max())}, expected 0..9")
    return x, y


def _load_idx_dataset(name: str, data_dir: str | None, limit_train: int | None, limit_test: int | None) -> Dataset:
    directory = _find_idx_dir(name, data_dir)
    x_train, y_train = _read_split(name, directory, "train_images", "train_labels")
    x_test, y_test = _read_split(name, directory, "test_images", "test_labels")

    def images(x: torch.Tensor, limit: int | None) -> torch.Tensor:
        x = x[:limit].unsqueeze(1).to(torch.float32)  # truncate before converting: cheaper
        return x.div_(255.0).sub_(0.5).div_(0.5)  # ToTensor() then Normalize((0.5,), (0.5,))

    return Dataset(
        name=name,
        x_train=images(x_train, limit_train),
        y_train=y_train[:limit_train].to(torch.int64),
        x_test=images(x_test, limit_test),
        y_test=y_test[:limit_test].to(torch.int64),
        num_classes=10,
        input_shape=(1, 28, 28),
        source=os.path.abspath(directory),
    )


# ------------------------------------------------------------------------------------ digits, synthetic


def _load_digits(limit_train: int | None, limit_test: int | None) -> Dataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError(
            "dataset 'digits' needs scikit-learn: `pip install scikit-learn` (or `pip install mixprec[digits]`)"
        ) from None
    x_np, y_np = load_digits(return_X_y=True)  # embedded in scikit-learn; no download
    x = torch.from_numpy(x_np).to(torch.float32).reshape(-1, 1, 8, 8)
    x = x.div_(16.0).sub_(0.5).div_(0.5)
    y = torch.from_numpy(y_np).to(torch.int64)

    # Stratified split: per class, a fixed-seed permutation; the first 20% go to the test set.
    g = torch.Generator().manual_seed(DIGITS_SPLIT_SEED)
    train_idx, test_idx = [], []
    for c in range(10):
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(idx.numel(), generator=g)]
        n_test = round(DIGITS_TEST_FRACTION * idx.numel())
        test_idx.append(idx[:n_test])
        train_idx.append(idx[n_test:])
    train_idx = torch.cat(train_idx).sort().values[:limit_train]
    test_idx = torch.cat(test_idx).sort().values[:limit_test]
    return Dataset(
        name="digits",
        x_train=x[train_idx],
        y_train=y[train_idx],
        x_test=x[test_idx],
        y_test=y[test_idx],
        num_classes=10,
        input_shape=(1, 8, 8),
        source="sklearn.datasets.load_digits",
    )


def _derived_seed(seed: int, stream: int) -> int:
    """Independent 64-bit seeds for the means, train and test streams of one user seed."""
    state = np.random.SeedSequence([seed % 2**64, stream]).generate_state(1, dtype=np.uint64)
    return int(state[0])


def _load_synthetic(seed: int, n_train: int, n_test: int, shape: tuple[int, ...], classes: int) -> Dataset:
    if n_train < 1 or n_test < 1:
        raise DataError(f"synthetic: synthetic_train={n_train} and synthetic_test={n_test} must both be >= 1")
    if len(shape) == 0 or any(not isinstance(d, (int, np.integer)) or d < 1 for d in shape):
        raise DataError(f"synthetic: synthetic_shape={shape!r} must be a non-empty tuple of positive ints")
    shape = tuple(int(d) for d in shape)
    if classes < 2:
        raise DataError(f"synthetic: synthetic_classes={classes} must be >= 2")
    dim = math.prod(shape)
    g = torch.Generator().manual_seed(_derived_seed(seed, 0))
    means = torch.randn(classes, dim, generator=g) * (SYNTHETIC_SEPARATION / math.sqrt(dim))

    def sample(n: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(_derived_seed(seed, stream))
        y = (torch.arange(n) % classes)[torch.randperm(n, generator=g)]  # balanced classes
        x = means[y] + torch.randn(n, dim, generator=g)
        return x.reshape(n, *shape), y

    x_train, y_train = sample(n_train, 1)  # separate streams: the test set does not depend on n_train
    x_test, y_test = sample(n_test, 2)
    return Dataset(
        name="synthetic",
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=classes,
        input_shape=tuple(shape),
        source=f"synthetic(seed={seed})",
    )


def load_dataset(
    name: str,
    *,
    data_dir: str | None = None,
    seed: int = 0,
    synthetic_train: int = 4096,
    synthetic_test: int = 1024,
    synthetic_shape: tuple[int, ...] = (1, 28, 28),
    synthetic_classes: int = 10,
    limit_train: int | None = None,
    limit_test: int | None = None,
) -> Dataset:
    """Load a dataset by name into memory.

    Args:
        data_dir: folder with the IDX files (fashion-mnist: optional, defaults to ``FASHION_MNIST_DIR``;
            mnist: required). ``DIR/FashionMNIST/raw`` or ``DIR/MNIST/raw`` (torchvision's layout) also work.
        seed: only ``synthetic`` uses it; the other datasets and the digits split are fixed.
        limit_train, limit_test: keep only the first N samples (for quick runs and tests).
    """
    for flag, limit in (("limit_train", limit_train), ("limit_test", limit_test)):
        if limit is not None and limit < 1:
            raise DataError(f"{flag}={limit} must be a positive number of samples (or None for all)")
    if name in ("fashion-mnist", "mnist"):
        return _load_idx_dataset(name, data_dir, limit_train, limit_test)
    if name == "digits":
        return _load_digits(limit_train, limit_test)
    if name == "synthetic":
        data = _load_synthetic(seed, synthetic_train, synthetic_test, tuple(synthetic_shape), synthetic_classes)
        if limit_train is None and limit_test is None:
            return data
        return Dataset(
            name=data.name,
            x_train=data.x_train[:limit_train],
            y_train=data.y_train[:limit_train],
            x_test=data.x_test[:limit_test],
            y_test=data.y_test[:limit_test],
            num_classes=data.num_classes,
            input_shape=data.input_shape,
            source=data.source,
        )
    raise DataError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")


# ---------------------------------------------------------------------------------------- loader


class BatchLoader:
    """In-memory batches by index slicing (no per-sample ``__getitem__``).

    Each epoch the indices ``0..N-1`` are permuted (if ``shuffle``) by a ``torch.Generator`` seeded with
    ``seed + epoch``, identical on every rank. With ``world_size > 1`` the permutation is padded by
    wrapping around to a multiple of ``world_size`` and rank ``r`` takes positions ``r, r + world_size, ...``
    (as ``DistributedSampler`` does), so shards are disjoint up to the padding and every rank runs the
    same number of batches. Call ``set_epoch(epoch)`` before each epoch, or every epoch repeats one order.

    Batches are ``x.index_select(0, idx)`` copies (or plain slices when unshuffled on one rank), on the
    device of ``x``; move the data to the device once, before building the loader.
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int = 0,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ):
        if x.shape[0] != y.shape[0]:
            raise DataError(f"BatchLoader: x has {x.shape[0]} samples but y has {y.shape[0]}")
        if batch_size < 1:
            raise DataError(f"--batch-size {batch_size} must be >= 1")
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"BatchLoader: rank={rank} must satisfy 0 <= rank < world_size={world_size}")
        self.x, self.y = x, y
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.num_samples = math.ceil(x.shape[0] / world_size)  # per rank, padding included

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation for ``epoch``; the same ``(seed, epoch)`` gives the same order."""
        self.epoch = epoch

    def _indices(self) -> torch.Tensor | None:
        """This rank's sample indices for the current epoch, or None for 'all, in order'."""
        n = self.x.shape[0]
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
        return order[self.rank : total : self.world_size].to(self.x.device)

    def __iter__(self):
        return self._batches(0)

    def _batches(self, first: int):
        if self.x.shape[0] == 0:
            return
        indices = self._indices()
        b = self.batch_size
        for i in range(first, len(self)):
            if indices is None:
                yield self.x[i * b : (i + 1) * b], self.y[i * b : (i + 1) * b]
            else:
                idx = indices[i * b : (i + 1) * b]
                yield self.x.index_select(0, idx), self.y.index_select(0, idx.to(self.y.device))

    def iter_from(self, first: int):
        """The epoch's batches from batch ``first`` on (a resumed epoch; the skipped ones are not built)."""
        return self._batches(first)

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)
