"""Data for the trainer: every source implements one protocol, and the trainer knows nothing else about data.

    protocol.py   DataSource and Loader (typing.Protocol), Batch, DataError
    builtin.py    the built-in datasets: fashion-mnist, mnist, digits, synthetic (load_dataset)
    idx.py        the IDX file reader of MNIST-style datasets
    sources.py    TensorData (in-memory tensors), UserBatches (doctor's batches), MapData (a user's datasets),
                  user_data / data_from_splits (a user's --dataset factory)
    text.py       TextCorpus: the character-level corpus of --dataset text, perplexity, bits per character
    loaders.py    BatchLoader, MapLoader, TextWindowLoader, FixedBatches: each epoch's order a pure function
                  of (seed, epoch), strided by rank, resumable mid-epoch
"""

from .builtin import DATASETS, FASHION_MNIST_DIR, load_dataset
from .idx import IdxFormatError, read_idx
from .loaders import BatchLoader, FixedBatches, MapLoader, TextWindowLoader
from .protocol import TASKS, Batch, DataError, DataSource, Loader
from .sources import MapData, TensorData, UserBatches, data_from_splits, user_data
from .text import TextCorpus, load_text_corpus

__all__ = [
    "DATASETS", "FASHION_MNIST_DIR", "load_dataset",
    "IdxFormatError", "read_idx",
    "BatchLoader", "FixedBatches", "MapLoader", "TextWindowLoader",
    "Batch", "DataError", "DataSource", "Loader", "TASKS",
    "MapData", "TensorData", "UserBatches", "data_from_splits", "user_data",
    "TextCorpus", "load_text_corpus",
]
