"""Models and data shaped the way people have them, for the model-contract tests (tests/test_model_contract.py).

Hugging Face models are built from tiny configs with random weights (nothing is downloaded); their factories
import transformers inside, so this module imports without it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

# ----------------------------------------------------------------------------------- Hugging Face models


def llama(vocab_size, block_size):
    """A raw ``LlamaForCausalLM``: forward(input_ids, ..., labels=None) -> CausalLMOutputWithPast."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=block_size, attn_implementation="eager"))


def gpt2(vocab_size, block_size):
    """A raw ``GPT2LMHeadModel``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_positions=block_size, n_embd=32, n_layer=2,
                                      n_head=4, attn_implementation="eager"))


BERT_VOCAB, BERT_LEN = 50, 12


def bert():
    """A raw ``BertForSequenceClassification`` (2 labels): takes input_ids, attention_mask, labels."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=BERT_VOCAB, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=64,
                                                    max_position_embeddings=BERT_LEN, num_labels=2,
                                                    attn_implementation="eager"))


class TokenDicts(Dataset):
    """Hugging Face-style samples: ``{'input_ids', 'attention_mask', 'token_type_ids', 'labels'}``; the label
    is whether token 7 occurs among the real (unpadded) tokens; sequences are right-padded with 0."""

    def __init__(self, n, seed, with_mask=True):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, BERT_VOCAB, (n, BERT_LEN), generator=g)
        lengths = torch.randint(4, BERT_LEN + 1, (n,), generator=g)
        self.mask = (torch.arange(BERT_LEN)[None, :] < lengths[:, None]).long()
        self.ids = self.ids * self.mask
        self.labels = (self.ids == 7).any(1).long()
        self.with_mask = with_mask

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        sample = {"input_ids": self.ids[i], "token_type_ids": torch.zeros(BERT_LEN, dtype=torch.long),
                  "labels": self.labels[i]}
        if self.with_mask:
            sample["attention_mask"] = self.mask[i]
        return sample


def bert_data():
    return TokenDicts(96, 0), TokenDicts(32, 1)


def bert_data_without_mask():
    return TokenDicts(96, 0, with_mask=False), TokenDicts(32, 1, with_mask=False)


class NeedsMask(nn.Module):
    """forward(input_ids, attention_mask) with no defaults: a batch dict without the mask cannot call it."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(BERT_VOCAB, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids) * attention_mask[..., None]
        return self.head(h.sum(1))


def needs_mask():
    return NeedsMask()


# ---------------------------------------------------------------------------------------- nanoGPT-style


class NanoGPT(nn.Module):
    """nanoGPT's calling convention: ``forward(idx, targets=None) -> (logits, loss)``, the loss computed on the
    targets as given (the data shifts them, the model does not)."""

    def __init__(self, vocab_size, block_size, d=32):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d)
        self.wpe = nn.Embedding(block_size, d)
        self.block = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.head = nn.Linear(d, vocab_size)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(block_size), persistent=False)
        self.calls_with_targets = 0

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        logits = self.head(self.block(x, src_mask=self.causal[:t, :t], is_causal=True))
        if targets is None:
            return logits, None
        self.calls_with_targets += 1
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def nanogpt(vocab_size, block_size):
    torch.manual_seed(0)
    return NanoGPT(vocab_size, block_size)


# ------------------------------------------------------------------------------ binary, regression, dtypes


def single_logit(input_shape):
    """A binary classifier with one logit per sample, shape (B, 1)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(input_shape[-1], 16), nn.ReLU(), nn.Linear(16, 1))


def binary_tensors():
    """Two Gaussian blobs; float 0/1 targets (what BCEWithLogitsLoss takes)."""
    g = torch.Generator().manual_seed(0)

    def split(n):
        y = torch.randint(0, 2, (n,), generator=g).float()
        x = torch.randn(n, 6, generator=g) + 1.5 * (2 * y[:, None] - 1)
        return x, y

    return split(256), split(101)


def mlp_regressor(input_shape, num_classes):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(input_shape[-1], 32), nn.ReLU(), nn.Linear(32, num_classes))


def diabetes():
    """scikit-learn's diabetes data as numpy has it (float64), standardised; the target scaled to unit size."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    y = (y - y.mean()) / y.std()
    x, y = torch.from_numpy(x), torch.from_numpy(y)  # float64, as numpy gives them
    return (x[:350], y[:350]), (x[350:], y[350:])


class NumpyPairs(Dataset):
    """A map-style dataset yielding ``(float64 numpy features, numpy int32 label)``, as people have data."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _blobs(seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, 120).astype(np.int32)
    x = rng.normal(size=(120, 5)) + 2.0 * np.eye(3, 5)[y]  # float64
    return x, y


def float64_int32_tensors():
    (x, y), (xt, yt) = _blobs(0), _blobs(1)
    return (torch.from_numpy(x), torch.from_numpy(y)), (torch.from_numpy(xt), torch.from_numpy(yt))


def float64_int32_datasets():
    return NumpyPairs(*_blobs(0)), NumpyPairs(*_blobs(1))


def linear5(num_classes):
    torch.manual_seed(0)
    return nn.Linear(5, num_classes)


# ------------------------------------------------------------------------------------------- bad outputs


class DictWithoutLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, x):
        return {"scores": self.lin(x)}  # neither 'logits' nor 'loss'


def unusable_output():
    return DictWithoutLogits()
