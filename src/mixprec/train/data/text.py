"""A character-level text corpus for the language-model case (``--dataset text``); nothing is downloaded.

The default corpus is the Debian package ``fortunes`` (``DEFAULT_TEXT_PATH``). :func:`load_text_corpus` reads one
UTF-8 file, or the regular files directly inside a folder in name order (hidden, ``*.dat`` and ``*.u8`` files
skipped, each file once); a file that is not UTF-8 is an error naming the file and byte offset, never skipped.

The first ``TRAIN_FRACTION`` of the characters (by position, the same for every seed) is the training split. The
vocabulary is the training split's characters only, ids ``1..V-1`` in code-point order; ``UNK_ID`` = 0 stands
for characters it lacks. Training batches are :class:`~mixprec.train.data.loaders.TextWindowLoader` windows; the
test set is consecutive non-overlapping windows (optionally ``max_test_windows`` evenly spaced ones),
independent of seed and batch size. Loss is nats per character; ``bits_per_char = loss / ln 2``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from ...validate import positive_int
from .loaders import TextWindowLoader, on_device, select_batches
from .protocol import Batch, DataError

__all__ = [
    "DEFAULT_TEXT_PATH",
    "TRAIN_FRACTION",
    "UNK_ID",
    "TextCorpus",
    "bits_per_char",
    "load_text_corpus",
    "text_data",
    "perplexity",
]

DEFAULT_TEXT_PATH = "/usr/share/games/fortunes"  # Debian package fortunes
TRAIN_FRACTION = 0.9
UNK_ID = 0
UNK_CHAR = "\ufffd"  # how decode() shows UNK_ID: U+FFFD REPLACEMENT CHARACTER
SKIP_SUFFIXES = (".dat", ".u8")
_HOW_TO_GET = f"pass --data-path FILE_OR_FOLDER of UTF-8 text, or `apt-get install fortunes` for {DEFAULT_TEXT_PATH}"


@dataclass(frozen=True, eq=False)
class TextCorpus:
    """A character-level corpus in memory. ``eq=False``: compared by identity, not by tensors."""

    train: torch.Tensor = field(repr=False)  # token ids of the training split, (N_train,)
    test: torch.Tensor = field(repr=False)  # token ids of the test split, (N_test,)
    x_test: torch.Tensor = field(repr=False)  # int64 (windows, block_size): fixed test windows
    y_test: torch.Tensor = field(repr=False)  # int64 (windows, block_size): their next characters
    itos: tuple[str, ...] = field(repr=False)  # itos[id] is the character of token id; itos[UNK_ID] == UNK_CHAR
    block_size: int
    source: str
    files: tuple[str, ...] = field(repr=False)
    test_unknown: int  # characters of the test split mapped to UNK_ID
    name: str = "text"
    _moved: dict = field(default_factory=dict, init=False, repr=False)  # the training split on an accelerator

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    @property
    def num_classes(self) -> int:
        """Same as ``vocab_size``: the model predicts one of them at each position."""
        return len(self.itos)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one sample: ``(block_size,)`` token ids."""
        return (self.block_size,)

    # -- the data-source protocol (mixprec.train.data.protocol.DataSource) --------------------------------
    task = "lm"
    notes: tuple[str, ...] = ()

    @property
    def n_train(self) -> int:
        """Characters of the training split."""
        return len(self.train)

    @property
    def n_test(self) -> int:
        """Test windows."""
        return len(self.x_test)

    def loader(self, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1, num_workers: int = 0,
               device: torch.device | None = None) -> TextWindowLoader:
        """Seeded random windows of the training split (in memory, so no workers), gathered on ``device`` (one
        copy of the split there, kept: :func:`~mixprec.train.data.loaders.on_device`)."""
        return TextWindowLoader(on_device(self.train, device, self._moved), self.block_size, batch_size, seed=seed,
                                rank=rank, world_size=world_size)

    def eval_batches(self, indices: torch.Tensor, batch_size: int) -> Iterator[Batch]:
        """The fixed test windows ``indices``, ``batch_size`` at a time."""
        return select_batches(self.x_test, self.y_test, indices, batch_size)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids (int64) of ``text``; characters outside the vocabulary become ``UNK_ID``."""
        return torch.from_numpy(_encode(_codepoints(text), _vocab_codepoints(self.itos))).long()

    def decode(self, ids) -> str:
        """The text of token ids; ``UNK_ID`` shows as U+FFFD."""
        return "".join(self.itos[int(i)] for i in ids)


def text_data(path: str | None, *, block_size: int, limit_test: int | None = None) -> TextCorpus:
    """``--dataset text``: the corpus at ``path`` (default: package fortunes), ``limit_test`` test windows."""
    return load_text_corpus(path, block_size=block_size, max_test_windows=limit_test)


def perplexity(loss: float) -> float:
    """``exp(loss)`` for a mean cross-entropy in nats; ``inf`` where that overflows a float."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def bits_per_char(loss: float) -> float:
    """A mean cross-entropy in nats per character, in bits per character: ``loss / ln 2``."""
    return loss / math.log(2)


# ------------------------------------------------------------------------------------------ reading


def _text_files(path: str) -> list[str]:
    """The files to read for ``path`` (a file, or a folder's plain text files; see the module docstring)."""
    if not os.path.exists(path):
        raise DataError(f"text corpus {path}: no such file or folder; {_HOW_TO_GET}")
    if not os.path.isdir(path):
        return [path]
    files, seen = [], set()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name.startswith(".") or name.endswith(SKIP_SUFFIXES) or not os.path.isfile(full):
            continue
        real = os.path.realpath(full)
        if real not in seen:
            seen.add(real)
            files.append(full)
    if not files:
        raise DataError(
            f"text corpus {path}: the folder has no text files (hidden files, sub-folders, *.dat and *.u8 are "
            f"skipped); {_HOW_TO_GET}"
        )
    return files


def _read_utf8(path: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"text corpus {path}: cannot read: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"text corpus {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}: {e.reason}); "
            "convert it (e.g. `iconv -f latin1 -t utf-8`) or remove it from the corpus"
        ) from None


def _read_corpus(path: str) -> tuple[str, list[str]]:
    files = _text_files(path)
    parts = []
    for f in files:
        text = _read_utf8(f)
        if text and not text.endswith("\n"):
            text += "\n"  # keep the last line of one file and the first of the next apart
        parts.append(text)
    text = "".join(parts)
    if not text:
        what = "file is" if len(files) == 1 else f"{len(files)} files are"
        raise DataError(f"text corpus {path}: the {what} empty; {_HOW_TO_GET}")
    return text, files


# ----------------------------------------------------------------------------------------- encoding


def _codepoints(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4")


def _vocab_codepoints(itos: tuple[str, ...]) -> np.ndarray:
    return np.array([ord(c) for c in itos[1:]], dtype=np.uint32)


def _encode(codepoints: np.ndarray, vocab: np.ndarray) -> np.ndarray:
    """Ids ``1 + position in the sorted vocab``, or ``UNK_ID`` for code points not in it (int64)."""
    pos = np.searchsorted(vocab, codepoints)
    found = vocab[np.minimum(pos, len(vocab) - 1)] == codepoints
    return np.where(found, pos + 1, UNK_ID).astype(np.int64)


def _token_dtype(vocab_size: int) -> torch.dtype:
    if vocab_size <= 256:
        return torch.uint8
    return torch.int16 if vocab_size <= 2**15 else torch.int32


def _test_windows(test: torch.Tensor, block_size: int, cap: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive non-overlapping windows of the test split, or ``cap`` evenly spaced ones of them."""
    n_windows = (len(test) - 1) // block_size
    chosen = torch.arange(n_windows)
    if cap is not None and cap < n_windows:
        chosen = torch.arange(cap) * n_windows // cap
    idx = chosen[:, None] * block_size + torch.arange(block_size + 1)
    windows = test.long()[idx]
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def load_text_corpus(path: str | None = None, *, block_size: int, max_test_windows: int | None = None) -> TextCorpus:
    """Read, split, build the vocabulary of and encode a character-level corpus (see the module docstring).

    ``path`` None reads ``DEFAULT_TEXT_PATH``; both splits need at least ``block_size + 1`` characters.
    Raises DataError (one line naming the fix) for anything unreadable, non-UTF-8, empty or too short.
    """
    positive_int("block_size", block_size, error=DataError)
    positive_int("max_test_windows", max_test_windows, allow_none=True, error=DataError)
    path = os.path.expanduser(DEFAULT_TEXT_PATH if path is None else os.fspath(path))
    text, files = _read_corpus(path)
    codes = _codepoints(text)
    n_train = int(len(codes) * TRAIN_FRACTION)
    n_test = len(codes) - n_train
    if min(n_train, n_test) < block_size + 1:
        longest = min(n_train, n_test) - 1
        fix = f"use --block-size {longest} or less, or more text" if longest >= 1 else "use more text"
        raise DataError(
            f"text corpus {path}: {len(codes)} characters split {n_train} train / {n_test} test, but each split "
            f"needs at least block_size + 1 = {block_size + 1}; {fix}"
        )
    vocab = np.unique(codes[:n_train])  # sorted code points of the training split only
    itos = (UNK_CHAR, *(chr(c) for c in vocab))
    ids = torch.from_numpy(_encode(codes, vocab)).to(_token_dtype(len(itos)))
    train, test = ids[:n_train], ids[n_train:]
    x_test, y_test = _test_windows(test, block_size, max_test_windows)
    return TextCorpus(train=train, test=test, x_test=x_test, y_test=y_test, itos=itos, block_size=block_size,
                      source=os.path.abspath(path), files=tuple(files),
                      test_unknown=int((test == UNK_ID).sum()))
