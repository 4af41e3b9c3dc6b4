import gzip
import inspect
import os

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mixprec.train.config import DataConfig
from mixprec.train.data import (
    DATASETS,
    FASHION_MNIST_DIR,
    TASKS,
    BatchLoader,
    DataError,
    DataSource,
    FixedBatches,
    Loader,
    MapData,
    TensorData,
    TextCorpus,
    TextWindowLoader,
    UserBatches,
    data_from_splits,
    load_dataset,
    load_text_corpus,
    read_idx,
)
from mixprec.train.data.loaders import _epoch_seed

IDX_NAMES = {
    "train-images-idx3-ubyte": "images",
    "train-labels-idx1-ubyte": "labels",
    "t10k-images-idx3-ubyte": "images",
    "t10k-labels-idx1-ubyte": "labels",
}


def idx_bytes(array: np.ndarray) -> bytes:
    magic = 0x0800 | array.ndim
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write(path, data: bytes, gz: bool):
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def write_idx_dir(directory, n_train=12, n_test=5, gz=False, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test),
    }
    for name, array in arrays.items():
        write(directory / name, idx_bytes(array), gz)
    return arrays


# ------------------------------------------------------------------------------------------ read_idx


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_roundtrip(tmp_path, gz):
    images = np.arange(3 * 28 * 28).reshape(3, 28, 28) % 256
    labels = np.array([0, 9, 4])
    pi = write(tmp_path / "img", idx_bytes(images), gz)
    pl = write(tmp_path / "lab", idx_bytes(labels), gz)
    x, y = read_idx(pi), read_idx(str(pl))
    assert x.dtype == torch.uint8 and x.shape == (3, 28, 28)
    assert torch.equal(x, torch.from_numpy(images.astype(np.uint8)))
    assert y.tolist() == [0, 9, 4]


def test_read_idx_bad_magic(tmp_path):
    data = bytearray(idx_bytes(np.zeros(4)))
    data[2] = 0x0D  # float32 type code
    path = write(tmp_path / "bad", bytes(data), gz=False)
    with pytest.raises(DataError, match=r"bad.*magic 0x00000d01"):
        read_idx(path)


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_truncated_and_trailing(tmp_path, gz):
    data = idx_bytes(np.zeros((2, 28, 28)))
    path = write(tmp_path / "short", data[:-1], gz)
    with pytest.raises(DataError, match=r"short.*truncated.*\(2, 28, 28\)"):
        read_idx(path)
    path = write(tmp_path / "long", data + b"\0", gz)
    with pytest.raises(DataError, match="trailing bytes"):
        read_idx(path)


def test_read_idx_corrupt_gzip_and_missing(tmp_path):
    path = tmp_path / "x.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.zeros(10)))[:-12])
    with pytest.raises(DataError, match="x.gz"):
        read_idx(path)
    with pytest.raises(DataError, match="nope.*not found"):
        read_idx(tmp_path / "nope")


# ------------------------------------------------------------------------------------ fashion-mnist / mnist


@pytest.mark.parametrize("gz", [False, True])
def test_load_idx_dataset(tmp_path, gz):
    arrays = write_idx_dir(tmp_path, gz=gz)
    data = load_dataset("mnist", data_dir=str(tmp_path))
    assert isinstance(data, TensorData)
    assert data.x_train.shape == (12, 1, 28, 28) and data.x_test.shape == (5, 1, 28, 28)
    assert data.x_train.dtype == torch.float32 and data.y_train.dtype == torch.int64
    assert data.input_shape == (1, 28, 28) and data.num_classes == 10
    assert data.source == str(tmp_path)
    expected = (torch.from_numpy(arrays["train-images-idx3-ubyte"]).float() / 255 - 0.5) / 0.5
    torch.testing.assert_close(data.x_train[:, 0], expected, rtol=0, atol=0)
    assert data.y_test.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()

    limited = load_dataset("fashion-mnist", data_dir=str(tmp_path), limit_train=4, limit_test=2)
    assert len(limited.x_train) == len(limited.y_train) == 4 and len(limited.y_test) == 2
    torch.testing.assert_close(limited.x_train, data.x_train[:4], rtol=0, atol=0)


def test_prefers_existing_file_raw_or_gz(tmp_path):
    write_idx_dir(tmp_path, gz=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(np.full(5, 7)), gz=False)  # mixed raw and gz
    assert load_dataset("mnist", data_dir=str(tmp_path)).y_test.tolist() == [7] * 5


def test_torchvision_layout(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"  # where torchvision.datasets.FashionMNIST(root=DIR) puts them
    raw.mkdir(parents=True)
    write_idx_dir(raw, gz=True)
    data = load_dataset("fashion-mnist", data_dir=str(tmp_path))
    assert data.x_train.shape[0] == 12 and data.source == str(raw)


def test_count_mismatch(tmp_path):
    write_idx_dir(tmp_path)
    write(tmp_path / "train-labels-idx1-ubyte", idx_bytes(np.zeros(11)), gz=False)
    with pytest.raises(DataError, match=r"12 images but .*11 labels"):
        load_dataset("mnist", data_dir=str(tmp_path))


def test_swapped_or_wrong_shape_files(tmp_path):
    write_idx_dir(tmp_path)
    write(tmp_path / "train-images-idx3-ubyte", idx_bytes(np.zeros(12)), gz=False)
    with pytest.raises(DataError, match="train-images.*expected images"):
        load_dataset("mnist", data_dir=str(tmp_path))
    write(tmp_path / "train-images-idx3-ubyte", idx_bytes(np.zeros((12, 32, 32))), gz=False)
    with pytest.raises(DataError, match=r"\(32, 32\), expected \(28, 28\)"):
        load_dataset("mnist", data_dir=str(tmp_path))


def test_corrupt_file_says_how_to_fix(tmp_path):
    write_idx_dir(tmp_path)
    path = tmp_path / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DataError, match="t10k-images.*truncated.*--data-dir"):
        load_dataset("fashion-mnist", data_dir=str(tmp_path))


def test_missing_file_message(tmp_path):
    write_idx_dir(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError) as e:
        load_dataset("fashion-mnist", data_dir=str(tmp_path))
    msg = str(e.value)
    assert "t10k-labels-idx1-ubyte" in msg and "apt-get install dataset-fashion-mnist" in msg and "--data-dir" in msg


def test_missing_dir_and_mnist_needs_data_dir(tmp_path):
    with pytest.raises(DataError, match="does not exist.*apt-get.*--data-dir"):
        load_dataset("fashion-mnist", data_dir=str(tmp_path / "absent"))
    with pytest.raises(DataError, match="--data-dir"):
        load_dataset("mnist")


def _fashion_mnist_present() -> bool:
    return all(
        os.path.exists(os.path.join(FASHION_MNIST_DIR, n)) or os.path.exists(os.path.join(FASHION_MNIST_DIR, n + ".gz"))
        for n in IDX_NAMES
    )


@pytest.mark.slow  # reads the whole real dataset
@pytest.mark.skipif(
    not _fashion_mnist_present(),
    reason=f"Fashion-MNIST not installed in {FASHION_MNIST_DIR} (apt-get install dataset-fashion-mnist)",
)
def test_real_fashion_mnist():
    data = load_dataset("fashion-mnist")
    assert data.x_train.shape == (60000, 1, 28, 28) and data.y_train.shape == (60000,)
    assert data.x_test.shape == (10000, 1, 28, 28) and data.y_test.shape == (10000,)
    assert data.y_train.min() == 0 and data.y_train.max() == 9
    assert torch.bincount(data.y_train).tolist() == [6000] * 10  # Fashion-MNIST is exactly balanced
    assert data.x_train.min() == -1.0 and data.x_train.max() == 1.0
    assert data.source == FASHION_MNIST_DIR


# ------------------------------------------------------------------------------------ digits, synthetic


def test_digits_split_fixed_disjoint_stratified():
    pytest.importorskip("sklearn")
    a = load_dataset("digits", seed=0)
    b = load_dataset("digits", seed=123)  # the training seed does not move the split
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert a.x_train.shape[1:] == (1, 8, 8) and a.input_shape == (1, 8, 8) and a.num_classes == 10
    assert len(a.y_train) + len(a.y_test) == 1797 and 340 <= len(a.y_test) <= 380
    assert a.x_train.min() >= -1 and a.x_train.max() <= 1
    # disjoint: no test image appears in the training set
    train_rows = {tuple(r) for r in a.x_train.flatten(1).tolist()}
    test_rows = [tuple(r) for r in a.x_test.flatten(1).tolist()]
    assert len(train_rows) == len(a.x_train)  # load_digits has no duplicate images, so rows identify samples
    assert not any(r in train_rows for r in test_rows)
    counts = torch.bincount(a.y_test, minlength=10)
    assert counts.min() >= 34 and counts.max() <= 38  # stratified


def test_synthetic_deterministic_and_learnable():
    kw = dict(synthetic_test=100, synthetic_shape=(12,), synthetic_classes=4)
    a = load_dataset("synthetic", seed=3, synthetic_train=400, **kw)
    b = load_dataset("synthetic", seed=3, synthetic_train=400, **kw)
    c = load_dataset("synthetic", seed=4, synthetic_train=400, **kw)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)
    assert a.x_train.shape == (400, 12) and a.input_shape == (12,) and a.num_classes == 4
    assert a.source == "synthetic(seed=3)" and a.y_train.dtype == torch.int64
    assert torch.bincount(a.y_train).tolist() == [100] * 4
    # nearest class mean (estimated on train) classifies the test set far above chance (25%)
    means = torch.stack([a.x_train[a.y_train == k].mean(0) for k in range(4)])
    pred = torch.cdist(a.x_test, means).argmin(1)
    assert (pred == a.y_test).float().mean() > 0.8
    # the test set does not depend on the training-set size
    d = load_dataset("synthetic", seed=3, synthetic_train=50, **kw)
    assert torch.equal(d.x_test, a.x_test)


def test_synthetic_default_shape_and_limits():
    data = load_dataset("synthetic", limit_train=10, limit_test=3)
    assert data.x_train.shape == (10, 1, 28, 28) and data.x_test.shape == (3, 1, 28, 28)
    assert data.input_shape == (1, 28, 28) and data.x_train.dtype == torch.float32


def test_bad_dataset_args():
    with pytest.raises(DataError, match="choose one of: " + ", ".join(DATASETS)):
        load_dataset("cifar10")
    with pytest.raises(DataError, match="--limit-train must be a positive integer, got 0"):
        load_dataset("synthetic", limit_train=0)
    with pytest.raises(DataError, match="synthetic_shape"):
        load_dataset("synthetic", synthetic_shape=(0, 4))
    with pytest.raises(DataError, match="synthetic_classes"):
        load_dataset("synthetic", synthetic_classes=1)


# ---------------------------------------------------------------------------------------- BatchLoader


def order(loader):
    return torch.cat([yb for _, yb in loader]).tolist()


def make(n=10, **kw):
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, 3)
    y = torch.arange(n)
    return BatchLoader(x, y, **kw)


@pytest.mark.parametrize("shuffle", [False, True])
def test_loader_covers_every_sample_once(shuffle):
    loader = make(10, batch_size=3, shuffle=shuffle)
    batches = list(loader)
    assert len(loader) == len(batches) == 4
    assert [len(yb) for _, yb in batches] == [3, 3, 3, 1]
    for xb, yb in batches:
        assert torch.equal(xb[:, 0], yb.float())  # x and y stay paired
    assert sorted(order(loader)) == list(range(10))
    if not shuffle:
        assert order(loader) == list(range(10))


def test_loader_shuffle_is_function_of_seed_and_epoch():
    a, b = make(50, batch_size=8, shuffle=True, seed=1), make(50, batch_size=8, shuffle=True, seed=1)
    a.set_epoch(2)
    b.set_epoch(2)
    assert order(a) == order(b)
    assert order(a) == order(a)  # iterating again without set_epoch repeats the epoch's order
    first = order(a)
    a.set_epoch(3)
    assert order(a) != first
    assert sorted(order(a)) == list(range(50))
    assert order(make(50, batch_size=8, shuffle=True, seed=2)) != order(make(50, batch_size=8, shuffle=True, seed=1))


def test_loader_drop_last():
    loader = make(10, batch_size=3, shuffle=True, drop_last=True)
    batches = list(loader)
    assert len(loader) == len(batches) == 3 and all(len(yb) == 3 for _, yb in batches)
    assert len(make(9, batch_size=3, shuffle=False, drop_last=True)) == 3


@pytest.mark.parametrize("n", [10, 11, 1])
def test_loader_shards(n):
    ranks = [make(n, batch_size=2, shuffle=True, seed=5, rank=r, world_size=2) for r in range(2)]
    for r in ranks:
        r.set_epoch(7)
    orders = [order(r) for r in ranks]
    assert len(ranks[0]) == len(ranks[1]) and len(orders[0]) == len(orders[1]) == -(-n // 2)
    together = orders[0] + orders[1]
    assert set(together) == set(range(n))  # every sample is seen by some rank
    padding = len(together) - n
    assert padding == (n % 2)  # only the wrap-around duplicates
    if padding == 0:
        assert set(orders[0]).isdisjoint(orders[1])
    # the ranks split one permutation: the same one a single process would use
    single = make(n, batch_size=2, shuffle=True, seed=5)
    single.set_epoch(7)
    interleaved = [v for pair in zip(orders[0], orders[1]) for v in pair]
    assert interleaved[:n] == order(single)


def test_loader_bad_args():
    with pytest.raises(DataError, match="--batch-size"):
        make(batch_size=0, shuffle=False)
    with pytest.raises(DataError, match="rank"):
        make(batch_size=2, shuffle=False, rank=2, world_size=2)
    with pytest.raises(DataError, match="samples"):
        BatchLoader(torch.zeros(3, 2), torch.zeros(4), 2, shuffle=False)


# ------------------------------------------------------------------------------------ the data-source protocol


class _Pairs(torch.utils.data.Dataset):
    """A map-style dataset over tensors: what a user's factory might return."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _sources(tmp_path):
    synthetic = load_dataset("synthetic", synthetic_train=40, synthetic_test=10, synthetic_shape=(3,))
    splits = (_Pairs(synthetic.x_train, synthetic.y_train), _Pairs(synthetic.x_test, synthetic.y_test))
    mapped = data_from_splits(splits, "test:pairs")
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 10, encoding="utf-8")
    return {
        "tensors": synthetic,
        "user batches": UserBatches([(torch.randn(4, 3), torch.tensor([0, 2, 1, 2]))]),
        "map-style": mapped,
        "text": load_text_corpus(str(text), block_size=8),
    }


def test_every_source_and_its_loader_implement_the_protocol(tmp_path):
    sources = _sources(tmp_path)
    assert [type(s) for s in sources.values()] == [TensorData, UserBatches, MapData, TextCorpus]
    for what, src in sources.items():
        assert isinstance(src, DataSource), what
        assert isinstance(src.name, str) and isinstance(src.source, str) and (src.task is None or src.task in TASKS), what
        assert isinstance(src.input_shape, tuple) and src.num_classes >= 1, what
        assert src.n_train >= 1 and src.n_test >= 0, what
        # every keyword the protocol names is accepted (isinstance does not check signatures)
        loader = src.loader(4, seed=0, rank=0, world_size=1, num_workers=0, device=torch.device("cpu"))
        assert isinstance(loader, Loader), what
        loader.set_epoch(1)
        batches = list(loader)
        assert len(batches) == len(loader) >= 1 and loader.num_samples >= 1, what
        assert len(list(loader.iter_from(1))) == len(loader) - 1, what
        x, y = batches[0]
        assert tuple(x.shape[1:]) == src.input_shape, what
        evaluated = list(src.eval_batches(torch.arange(min(3, src.n_test)), 2))
        assert sum(len(yb) for _, yb in evaluated) == min(3, src.n_test), what


def test_the_protocol_refuses_what_lacks_a_member():
    class NoEval:
        name, source, task, input_shape, num_classes, n_train, n_test = "x", "x", "classify", (1,), 2, 1, 0

        def loader(self, batch_size, *, seed, rank=0, world_size=1, num_workers=0, device=None):
            return FixedBatches([])

    class NoResume(list):
        num_samples = 0

        def set_epoch(self, epoch):
            pass

    assert not isinstance(NoEval(), DataSource)
    assert not isinstance(NoResume(), Loader)
    assert isinstance(FixedBatches([]), Loader)


def _tensors(batch):
    if isinstance(batch, torch.Tensor):
        return [batch]
    return [t for v in (batch.values() if isinstance(batch, dict) else batch) for t in _tensors(v)]


def test_every_loader_yields_contiguous_tensors(tmp_path):
    """A model may ``.view`` its inputs and targets (nanoGPT's ``targets.view(-1)``): every batch of every loader
    and every evaluation batch is contiguous, as a DataLoader's collate makes it, whatever the data's strides."""
    x, y = torch.randn(5, 3, 40).permute(2, 1, 0), torch.arange(80)[::2]  # (40, 3, 5) and (40,): neither contiguous
    assert not (x.is_contiguous() or x[:4].is_contiguous() or y.is_contiguous())
    strided = {
        "tensors": TensorData(name="t", x_train=x, y_train=y, x_test=x, y_test=y, num_classes=40,
                              input_shape=(3, 5), source="test"),
        "several inputs": TensorData(name="t", x_train=(x, x), y_train=y, x_test=(x, x), y_test=y, num_classes=40,
                                     input_shape=(3, 5), source="test"),
        "dict": TensorData(name="t", x_train={"x": x, "labels": y}, y_train=None, x_test={"x": x, "labels": y},
                           y_test=None, num_classes=40, input_shape=(3, 5), source="test"),
        "user batches": UserBatches([(x[:4], y[:4]), {"x": x[4:8], "labels": y[4:8]}]),
        "map-style": data_from_splits((_Pairs(x, y), _Pairs(x, y)), "test:pairs"),
    }
    sources = {**_sources(tmp_path), **strided}
    loaders = {what: [src.loader(4, seed=0), src.loader(4, seed=0, rank=1, world_size=2)]
               for what, src in sources.items()}
    loaders["in order"] = [BatchLoader(x, y, 4, shuffle=False),
                           BatchLoader({"x": x, "labels": y}, None, 4, shuffle=False)]
    for what, some in loaders.items():
        for loader in some:
            for batch in [*loader, *loader.iter_from(1)]:
                assert all(t.is_contiguous() for t in _tensors(batch)), what
    for what, src in sources.items():
        for batch in src.eval_batches(torch.arange(min(6, src.n_test)), 4):
            assert all(t.is_contiguous() for t in _tensors(batch)), what


@pytest.mark.parametrize("world_size", [1, 2])
def test_map_style_path_gives_batch_loaders_batches(world_size):
    """The DataLoader path (seeded DistributedSampler) yields exactly BatchLoader's batches, resumed ones too."""
    x = torch.arange(23, dtype=torch.float32).unsqueeze(1)
    y = torch.arange(23)
    tensors = TensorData(name="t", x_train=x, y_train=y, x_test=x, y_test=y, num_classes=23, input_shape=(1,),
                         source="test")
    mapped = data_from_splits((_Pairs(x, y), _Pairs(x, y)), "test:pairs")
    def labels(batches):
        return [yb.tolist() for _, yb in batches]

    for rank in range(world_size):
        a = tensors.loader(4, seed=9, rank=rank, world_size=world_size)
        b = mapped.loader(4, seed=9, rank=rank, world_size=world_size)
        assert len(a) == len(b) and a.num_samples == b.num_samples
        epochs = []
        for epoch in (0, 3):
            a.set_epoch(epoch)
            b.set_epoch(epoch)
            epochs.append(labels(a))
            assert epochs[-1] == labels(b)
            assert labels(a.iter_from(2)) == labels(b.iter_from(2)) == epochs[-1][2:]
        assert epochs[0] != epochs[1]  # the orders are shuffled, so equal orders mean something


def test_user_batches_classes_only_for_integer_labels():
    x = torch.randn(3, 5)
    assert UserBatches([(x, torch.tensor([0, 4, 1])), (x, torch.tensor([2, 2, 2]))]).num_classes == 5
    assert UserBatches([(x, torch.randn(3))]).num_classes == 0  # regression targets: not classes
    assert UserBatches([(x, torch.tensor([-1, 0, 1]))]).num_classes == 0
    assert UserBatches([(x, torch.tensor([0, 1, 1]))]).input_shape == (5,)


def test_synthetic_defaults_are_the_configs():
    params = inspect.signature(load_dataset).parameters
    config = DataConfig()
    for name in ("synthetic_train", "synthetic_test", "synthetic_shape", "limit_train", "limit_test"):
        assert params[name].default == getattr(config, name), name


# ------------------------------------------------------------------------------------ on the run's device

META = torch.device("meta")


class _Transfers(TorchDispatchMode):
    """Counts the ops that touch tensors of more than one device: every copy between devices, explicit (``.to``)
    or implicit (a host index into a device tensor)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = tree_leaves((args, kwargs, out))
        self.count += len({t.device for t in leaves if isinstance(t, torch.Tensor)}) > 1
        return out


def _builtin_sources(tmp_path):
    write_idx_dir(tmp_path, n_train=40, n_test=5)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 20, encoding="utf-8")
    return {
        "synthetic": load_dataset("synthetic", synthetic_train=40, synthetic_test=10, synthetic_shape=(3,)),
        "digits": load_dataset("digits", limit_train=40, limit_test=10),
        "mnist": load_dataset("mnist", data_dir=str(tmp_path)),
        "text": load_text_corpus(str(text), block_size=8),
    }


def _training_split(loader):
    return [loader.tokens] if isinstance(loader, TextWindowLoader) else [loader.x, loader.y]


def test_builtin_datasets_index_their_batches_on_the_device_with_no_copy_per_step(tmp_path):
    """On an accelerator (the meta device stands in for CUDA here) every built-in dataset's training split is
    copied there once, shared by every loader of the source, and its batches are indexed there: an epoch copies
    across devices once (its order), never per batch. The source's own tensors stay on the host."""
    for what, src in _builtin_sources(tmp_path).items():
        loader = src.loader(4, seed=0, device=META)
        split = _training_split(loader)
        assert all(t.device == META for t in split), what
        assert all(a is b for a, b in zip(split, _training_split(src.loader(4, seed=1, device=META)))), what
        host = [src.train] if isinstance(src, TextCorpus) else [src.x_train, src.y_train]
        assert all(t.device.type == "cpu" for t in host), what
        loader.set_epoch(1)
        with _Transfers() as transfers:
            batches = iter(loader)
            first = next(batches)
            at_first = transfers.count
            rest = list(batches)
        assert len(rest) >= 2 and at_first <= 1 and transfers.count == at_first, (what, transfers.count)
        assert all(t.device == META for b in [first, *rest] for t in _tensors(b)), what


def test_on_the_cpu_and_for_a_users_tensors_the_loader_uses_the_tensors_as_they_are(tmp_path):
    """The CPU path does not change (no copy: the loader batches the source's own tensors), and a user's tensors
    stay where they are whatever the device."""
    for what, src in _builtin_sources(tmp_path).items():
        host = [src.train] if isinstance(src, TextCorpus) else [src.x_train, src.y_train]
        for device in (None, torch.device("cpu")):
            assert all(a is b for a, b in zip(_training_split(src.loader(4, seed=0, device=device)), host)), what
    x, y = torch.randn(8, 3), torch.arange(8)
    user = data_from_splits(((x, y), (x, y)), "test:tensors")
    loader = user.loader(4, seed=0, device=META)
    assert not user.resident and loader.x is user.x_train and loader.y is user.y_train


def test_text_windows_are_the_positions_drawn_step_by_step():
    """The text loader draws an epoch's positions at its start (one copy to the device): the same windows as
    drawing ``world_size * batch_size`` positions per step from the ``(seed, epoch)`` generator."""
    tokens = torch.randint(0, 50, (500,), dtype=torch.uint8)
    loader = TextWindowLoader(tokens, 8, 3, seed=5, steps_per_epoch=6, rank=1, world_size=2)
    loader.set_epoch(2)
    g = torch.Generator().manual_seed(_epoch_seed(5, 2))
    for x, y in loader:
        starts = torch.randint(0, 500 - 8, (6,), generator=g)[1::2]
        windows = tokens[starts[:, None] + torch.arange(9)].long()
        assert torch.equal(x, windows[:, :-1]) and torch.equal(y, windows[:, 1:])
    assert list(loader.iter_from(6)) == []


@pytest.mark.cuda
def test_builtin_batches_on_cuda_are_the_cpu_batches_and_no_step_copies_from_the_host(tmp_path):
    """On CUDA: the training split lives on the GPU, the batches equal the CPU's bit for bit, and an epoch's
    batches make at most one host-to-device copy (its order), none per step (torch.profiler's memcpy records)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device("cuda")
    for what, src in _builtin_sources(tmp_path).items():
        on_gpu, on_cpu = src.loader(4, seed=3, device=cuda), src.loader(4, seed=3, device=torch.device("cpu"))
        assert all(t.device.type == "cuda" for t in _training_split(on_gpu)), what
        on_gpu.set_epoch(1)
        on_cpu.set_epoch(1)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            gpu_batches = list(on_gpu)
            torch.cuda.synchronize()
        copies = [e for e in prof.events() if "memcpy" in e.name.lower() and "htod" in e.name.lower()]
        assert len(copies) <= 1, (what, [e.name for e in copies])
        cpu_batches = list(on_cpu)
        assert len(gpu_batches) == len(cpu_batches) >= 2, what
        for g, c in zip(gpu_batches, cpu_batches):
            assert all(a.device.type == "cuda" and torch.equal(a.cpu(), b) for a, b in zip(_tensors(g), _tensors(c)))
