"""The built-in datasets: ``fashion-mnist``, ``mnist``, ``digits`` and ``synthetic``. Nothing is ever downloaded.

Each loads into a :class:`~mixprec.train.data.sources.TensorData`, its training split resident on the device.

- ``fashion-mnist`` / ``mnist``: the four IDX files (raw or ``.gz``, :mod:`.idx`) from ``data_dir``;
  Fashion-MNIST falls back to ``FASHION_MNIST_DIR``. Images are float32 ``(N, 1, 28, 28)``,
  ``(x / 255 - 0.5) / 0.5``, as the tutorial's ``Normalize((0.5,), (0.5,))``.
- ``digits``: scikit-learn's 8x8 digits, split 80/20 with a fixed seed (``DIGITS_SPLIT_SEED``).
- ``synthetic``: a Gaussian mixture a linear model can learn, but not in zero steps; sizes from
  :class:`~mixprec.train.config.DataConfig`.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import torch

from ...validate import positive_int
from ..config import DataConfig
from .idx import IdxFormatError, read_idx
from .protocol import DataError
from .sources import TensorData

__all__ = ["DATASETS", "FASHION_MNIST_DIR", "IDX_FILES", "load_dataset"]

DATASETS = ("fashion-mnist", "mnist", "digits", "synthetic")
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # Debian package dataset-fashion-mnist
DIGITS_SPLIT_SEED = 0  # fixed: the digits test set is the same for every training seed
DIGITS_TEST_FRACTION = 0.2
SYNTHETIC_SEPARATION = 4.0  # class-mean distance / sqrt(2), in noise standard deviations
SYNTHETIC_CLASSES = 10

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
# Where torchvision's FashionMNIST(root=DIR) / MNIST(root=DIR) puts the raw files, also searched.
_TORCHVISION_SUBDIR = {"fashion-mnist": os.path.join("FashionMNIST", "raw"), "mnist": os.path.join("MNIST", "raw")}
_DEFAULT = DataConfig()


# ------------------------------------------------------------------------------------ fashion-mnist, mnist


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


def _load_idx_dataset(name: str, data_dir: str | None, limit_train: int | None,
                      limit_test: int | None) -> TensorData:
    directory = _find_idx_dir(name, data_dir)
    x_train, y_train = _read_split(name, directory, "train_images", "train_labels")
    x_test, y_test = _read_split(name, directory, "test_images", "test_labels")

    def images(x: torch.Tensor, limit: int | None) -> torch.Tensor:
        x = x[:limit].unsqueeze(1).to(torch.float32)  # truncate before converting: cheaper
        return x.div_(255.0).sub_(0.5).div_(0.5)  # ToTensor() then Normalize((0.5,), (0.5,))

    return TensorData(
        task="classify",
        name=name,
        x_train=images(x_train, limit_train),
        y_train=y_train[:limit_train].to(torch.int64),
        x_test=images(x_test, limit_test),
        y_test=y_test[:limit_test].to(torch.int64),
        num_classes=10,
        input_shape=(1, 28, 28),
        source=os.path.abspath(directory),
        resident=True,
    )


# ------------------------------------------------------------------------------------ digits, synthetic


def _load_digits(limit_train: int | None, limit_test: int | None) -> TensorData:
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
    return TensorData(
        task="classify",
        name="digits",
        x_train=x[train_idx],
        y_train=y[train_idx],
        x_test=x[test_idx],
        y_test=y[test_idx],
        num_classes=10,
        input_shape=(1, 8, 8),
        source="sklearn.datasets.load_digits",
        resident=True,
    )


def _derived_seed(seed: int, stream: int) -> int:
    """Independent 64-bit seeds for the means, train and test streams of one user seed."""
    state = np.random.SeedSequence([seed % 2**64, stream]).generate_state(1, dtype=np.uint64)
    return int(state[0])


def _load_synthetic(seed: int, n_train: int, n_test: int, shape: tuple[int, ...], classes: int) -> TensorData:
    positive_int("synthetic_train", n_train, error=DataError)
    positive_int("synthetic_test", n_test, error=DataError)
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
    return TensorData(
        task="classify",
        name="synthetic",
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=classes,
        input_shape=tuple(shape),
        source=f"synthetic(seed={seed})",
        resident=True,
    )


def load_dataset(
    name: str,
    *,
    data_dir: str | None = None,
    seed: int = 0,
    synthetic_train: int = _DEFAULT.synthetic_train,
    synthetic_test: int = _DEFAULT.synthetic_test,
    synthetic_shape: tuple[int, ...] = _DEFAULT.synthetic_shape,
    synthetic_classes: int = SYNTHETIC_CLASSES,
    limit_train: int | None = _DEFAULT.limit_train,
    limit_test: int | None = _DEFAULT.limit_test,
) -> TensorData:
    """Load a dataset by name into memory. ``data_dir`` may also use torchvision's ``DIR/MNIST/raw`` layout;
    ``seed`` applies to ``synthetic`` only; ``limit_*`` keep the first N samples."""
    positive_int("limit_train", limit_train, allow_none=True, error=DataError)
    positive_int("limit_test", limit_test, allow_none=True, error=DataError)
    if name in ("fashion-mnist", "mnist"):
        return _load_idx_dataset(name, data_dir, limit_train, limit_test)
    if name == "digits":
        return _load_digits(limit_train, limit_test)
    if name == "synthetic":
        data = _load_synthetic(seed, synthetic_train, synthetic_test, tuple(synthetic_shape), synthetic_classes)
        if limit_train is None and limit_test is None:
            return data
        return dataclasses.replace(data, x_train=data.x_train[:limit_train], y_train=data.y_train[:limit_train],
                                   x_test=data.x_test[:limit_test], y_test=data.y_test[:limit_test])
    raise DataError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
