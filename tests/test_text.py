import itertools
import math
import os

import pytest
import torch

from conftest import ROOT
from mixprec.errors import UsageError
from mixprec.train.data import BatchLoader, DataError, TextWindowLoader
from mixprec.train.data.text import (
    DEFAULT_TEXT_PATH,
    UNK_ID,
    bits_per_char,
    load_text_corpus,
    perplexity,
)

USERPKG = ROOT / "tests" / "userpkg"


def write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return str(path)


def batches(loader, epoch):
    loader.set_epoch(epoch)
    return [(x.clone(), y.clone()) for x, y in loader]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))


# ------------------------------------------------------------------------------------------ corpus


def test_split_by_position_and_vocabulary_from_train_only(tmp_path):
    text = "abcab" * 18 + "abxy\n" * 2  # 100 chars: train = first 90 ("abc" only); x, y, newline only in test
    corpus = load_text_corpus(write(tmp_path / "t.txt", text), block_size=4)
    assert corpus.itos == ("\ufffd", "a", "b", "c")  # UNK_ID first, then sorted train characters
    assert corpus.vocab_size == corpus.num_classes == 4
    assert corpus.input_shape == (4,)
    assert len(corpus.train) == 90 and len(corpus.test) == 10
    assert corpus.decode(corpus.train) == text[:90]
    assert corpus.decode(corpus.test) == "ab\ufffd\ufffd\ufffdab\ufffd\ufffd\ufffd"
    assert corpus.test_unknown == 6
    assert corpus.train.dtype == torch.uint8
    assert corpus.encode("cab?").tolist() == [3, 1, 2, UNK_ID]


def test_test_windows_are_consecutive_and_non_overlapping(tmp_path):
    text = "".join(chr(ord("a") + i % 26) for i in range(299)) + "\n"
    corpus = load_text_corpus(write(tmp_path / "t.txt", text), block_size=7)
    test = corpus.test.long()  # 30 characters -> (30 - 1) // 7 = 4 windows
    assert corpus.x_test.shape == corpus.y_test.shape == (4, 7)
    assert corpus.x_test.dtype == corpus.y_test.dtype == torch.int64
    for j in range(4):
        assert torch.equal(corpus.x_test[j], test[7 * j : 7 * j + 7])
        assert torch.equal(corpus.y_test[j], test[7 * j + 1 : 7 * j + 8])
    capped = load_text_corpus(write(tmp_path / "t.txt", text), block_size=7, max_test_windows=2)
    assert torch.equal(capped.x_test, corpus.x_test[[0, 2]])  # evenly spaced, deterministic
    # the unshuffled BatchLoader batches the fixed test windows
    loader = BatchLoader(corpus.x_test, corpus.y_test, 3, shuffle=False)
    assert [len(x) for x, _ in loader] == [3, 1]


def test_folder_reads_plain_files_in_name_order(tmp_path):
    write(tmp_path / "b", "second\n%\n")
    write(tmp_path / "a", "first\n%\nno newline at the end")
    (tmp_path / "a.dat").write_bytes(b"\x00\x00\x00\x02\xff\xfe")  # strfile index: binary, skipped
    os.symlink(tmp_path / "a", tmp_path / "a.u8")
    os.symlink(tmp_path / "b", tmp_path / "zz-link")  # the same file again through a link: read once
    write(tmp_path / ".hidden", "hidden\n")
    write(tmp_path / "empty", "")
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "c", "in a sub-folder\n")
    corpus = load_text_corpus(str(tmp_path), block_size=2)
    assert [os.path.basename(f) for f in corpus.files] == ["a", "b", "empty"]
    # a newline is added after "a", which lacks one; every test character also occurs in the train split
    assert corpus.decode(torch.cat([corpus.train, corpus.test])) == "first\n%\nno newline at the end\nsecond\n%\n"


def test_default_path_is_the_fortunes_package(monkeypatch, tmp_path):
    import mixprec.train.data.text as text_mod

    monkeypatch.setattr(text_mod, "DEFAULT_TEXT_PATH", str(tmp_path / "nowhere"))
    match = r"nowhere: no such file or folder; pass --data-path .*apt-get install fortunes"
    with pytest.raises(DataError, match=match):
        load_text_corpus(None, block_size=8)


@pytest.mark.parametrize(
    "setup, match",
    [
        (lambda p: str(p / "missing.txt"), r"missing.txt: no such file or folder; pass --data-path"),
        (lambda p: write(p / "e.txt", ""), r"e.txt: the file is empty"),
        (lambda p: str(p), r"the folder has no text files \(hidden files, sub-folders, \*.dat and \*.u8 are skipped\)"),
        (lambda p: (write(p / "e1", ""), write(p / "e2", ""), str(p))[-1], r"the 2 files are empty"),
        (lambda p: write(p / "short.txt", "x" * 49 + "\n"),
         r"50 characters split 45 train / 5 test, but each split needs at least block_size \+ 1 = 9; "
         r"use --block-size 4 or less"),
        (lambda p: write(p / "one.txt", "\n"), r"1 characters split 0 train / 1 test.*; use more text"),
    ],
    ids=["missing", "empty-file", "empty-folder", "empty-files", "too-short", "one-char"],
)
def test_bad_corpus_raises_one_line_usage_error(tmp_path, setup, match):
    path = setup(tmp_path)
    with pytest.raises(DataError, match=match) as info:
        load_text_corpus(path, block_size=8)
    assert isinstance(info.value, UsageError)
    assert "\n" not in str(info.value)


def test_non_utf8_file_names_file_and_offset(tmp_path):
    write(tmp_path / "good", "fine text\n" * 10)
    (tmp_path / "latin1").write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1: not UTF-8 text \(byte 0xe9 at offset 3: .*iconv -f latin1"):
        load_text_corpus(str(tmp_path), block_size=4)


@pytest.mark.parametrize("kwargs, match", [(dict(block_size=0), r"--block-size must be a positive integer, got 0"),
                                           (dict(block_size=4, max_test_windows=0), r"--max-test-windows must be a positive integer, got 0")])
def test_bad_sizes(tmp_path, kwargs, match):
    with pytest.raises(DataError, match=match):
        load_text_corpus(write(tmp_path / "t.txt", "x" * 100), **kwargs)


# ------------------------------------------------------------------------------------------ loader


def test_windows_are_next_token_pairs_within_bounds():
    n, t = 20, 6
    loader = TextWindowLoader(torch.arange(n, dtype=torch.int16), t, 8, seed=0, steps_per_epoch=200)
    starts = set()
    for x, y in loader:
        assert x.shape == y.shape == (8, t) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x - x[:, :1], torch.arange(t).expand(8, t))  # contiguous windows of the sequence
        assert torch.equal(y, x + 1)  # targets are the next tokens
        starts.update(x[:, 0].tolist())
    assert starts == set(range(n - t))  # every valid start, from 0 to N-T-1, and no other


def test_same_seed_and_epoch_give_the_same_batches_other_epochs_and_seeds_differ():
    tokens = torch.randint(0, 50, (1000,), dtype=torch.uint8)
    a = TextWindowLoader(tokens, 16, 4, seed=3, steps_per_epoch=5)
    b = TextWindowLoader(tokens, 16, 4, seed=3, steps_per_epoch=5)
    assert same(batches(a, 0), batches(b, 0))
    assert same(batches(a, 2), batches(b, 2))
    assert same(batches(a, 0), batches(a, 0))  # iterating again repeats the epoch
    assert not same(batches(a, 0), batches(a, 1))
    assert not same(batches(a, 0), batches(TextWindowLoader(tokens, 16, 4, seed=4, steps_per_epoch=5), 0))
    # (seed, epoch) is not seed + epoch: seed 3 epoch 1 differs from seed 4 epoch 0
    assert not same(batches(a, 1), batches(TextWindowLoader(tokens, 16, 4, seed=4, steps_per_epoch=5), 0))


def test_ranks_take_strided_columns_of_the_global_batch():
    tokens = torch.randint(0, 50, (1000,), dtype=torch.uint8)
    world = 3
    whole = batches(TextWindowLoader(tokens, 8, world * 4, seed=1, steps_per_epoch=6), 2)
    for rank in range(world):
        mine = batches(TextWindowLoader(tokens, 8, 4, seed=1, steps_per_epoch=6, rank=rank, world_size=world), 2)
        assert same(mine, [(x[rank::world], y[rank::world]) for x, y in whole])


def test_resuming_by_skipping_k_batches_gives_the_same_batches():
    tokens = torch.randint(0, 50, (1000,), dtype=torch.uint8)
    full = batches(TextWindowLoader(tokens, 8, 4, seed=7, steps_per_epoch=10), 3)
    resumed = TextWindowLoader(tokens, 8, 4, seed=7, steps_per_epoch=10)  # a fresh loader, as after a restart
    resumed.set_epoch(3)
    assert same([(x.clone(), y.clone()) for x, y in itertools.islice(resumed, 4, None)], full[4:])


def test_length_and_default_steps_per_epoch():
    tokens = torch.zeros(10_000, dtype=torch.uint8)
    assert len(TextWindowLoader(tokens, 10, 7, steps_per_epoch=3)) == 3
    assert len(list(TextWindowLoader(tokens, 10, 7, steps_per_epoch=3))) == 3
    assert len(TextWindowLoader(tokens, 10, 7)) == (10_000 - 10) // (7 * 10)  # one pass over the tokens
    assert len(TextWindowLoader(tokens, 10, 7, rank=1, world_size=2)) == (10_000 - 10) // (7 * 10 * 2)
    assert len(TextWindowLoader(tokens[:12], 10, 7)) == 1  # at least one batch


@pytest.mark.parametrize(
    "tokens, kwargs, match",
    [
        (torch.zeros(8), dict(), r"8 tokens cannot hold one window of block_size \+ 1 = 9; use --block-size 7"),
        (torch.zeros(2, 50), dict(), r"tokens must be one sequence \(1-D\)"),
        (torch.zeros(50), dict(batch_size=0), r"--batch-size must be a positive integer, got 0"),
        (torch.zeros(50), dict(steps_per_epoch=0), r"--steps-per-epoch must be a positive integer, got 0"),
        (torch.zeros(50), dict(rank=2, world_size=2), r"rank=2 must satisfy 0 <= rank < world_size=2"),
    ],
)
def test_bad_loader_arguments(tokens, kwargs, match):
    kwargs = dict(batch_size=4) | kwargs
    with pytest.raises(DataError, match=match):
        TextWindowLoader(tokens, 8, kwargs.pop("batch_size"), **kwargs)


# ----------------------------------------------------------------------------------------- metrics


def test_perplexity_and_bits_per_char():
    assert perplexity(math.log(2)) == pytest.approx(2.0, rel=1e-15)
    assert perplexity(0.0) == 1.0
    assert perplexity(1e6) == math.inf
    assert bits_per_char(math.log(2)) == pytest.approx(1.0, rel=1e-15)
    assert bits_per_char(math.log(256)) == pytest.approx(8.0, rel=1e-15)


# -------------------------------------------------------------------------------- the real corpus


@pytest.mark.skipif(not os.path.isdir(DEFAULT_TEXT_PATH), reason="Debian package fortunes not installed")
def test_fortunes_corpus():
    corpus = load_text_corpus(None, block_size=64)
    names = sorted(os.listdir(DEFAULT_TEXT_PATH))
    plain = [n for n in names if not n.endswith((".dat", ".u8")) and os.path.isfile(os.path.join(DEFAULT_TEXT_PATH, n))]
    assert [os.path.basename(f) for f in corpus.files] == plain
    n = len(corpus.train) + len(corpus.test)
    assert len(corpus.train) == int(0.9 * n)
    assert n > 1_000_000
    assert 90 <= corpus.vocab_size <= 256 and corpus.train.dtype == torch.uint8
    assert corpus.test_unknown < 100  # almost all test characters occur in the training split
    assert corpus.x_test.shape == ((len(corpus.test) - 1) // 64, 64)
    assert "%\n" in corpus.decode(corpus.x_test[:20].flatten())  # the '%' separators are kept


@pytest.mark.slow  # trains through the CLI
def test_a_model_that_views_its_inputs_and_targets_trains_on_text(cli, tmp_path):
    """nanoGPT's forward does ``targets.view(-1)``: the text batches must be contiguous, as a collated batch is."""
    corpus = write(tmp_path / "t.txt", "the quick brown fox jumps over the lazy dog\n" * 40)
    code, out, err = cli("train", "--model", f"{USERPKG / 'viewgpt.py'}:model", "--dataset", "text", "--data-path",
                         corpus, "--block-size", "16", "--batch-size", "8", "--max-steps", "2", "--epochs", "1",
                         "--limit-test", "4", "--log-every", "0", "--progress", "off", "--device", "cpu")
    assert code == 0, err
    assert "bits/char" in out
