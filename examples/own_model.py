"""Your own PyTorch model and data through mixprec — the factories `--model` / `--dataset` import.

From the command line (run in the repository root):

    mixprec train --model examples/own_model.py:make_model --dataset examples/own_model.py:make_data \\
        --precision bf16-mixed --epochs 2
    mixprec bench --model examples/own_model.py:make_model --dataset examples/own_model.py:make_data \\
        --precisions fp32,bf16-mixed --repeats 2 --epochs 2
    mixprec doctor --model examples/own_model.py:make_model --dataset examples/own_model.py:make_data

From Python: `python examples/own_model.py` (below).
"""

import torch
from torch import nn
from torch.utils.data import Dataset


class SmallResNet(nn.Module):
    """Two residual conv blocks and a linear head; takes (B, C, H, W) images."""

    def __init__(self, channels: int, num_classes: int, width: int = 32):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                          nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width))
            for _ in range(2))
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = torch.relu(x + block(x))
        return self.head(x.mean(dim=(2, 3)))


def make_model(input_shape, num_classes):
    """mixprec calls this with the arguments it declares (input_shape, num_classes, vocab_size, block_size)."""
    return SmallResNet(input_shape[0], num_classes)


class Digits(Dataset):
    """scikit-learn's 8x8 digits as a map-style dataset (one (image, label) per __getitem__)."""

    def __init__(self, train: bool):
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
        y = torch.tensor(d.target)
        cut = int(0.8 * len(x))
        self.x, self.y = (x[:cut], y[:cut]) if train else (x[cut:], y[cut:])

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def make_data():
    """Return (train, test): map-style datasets (through a DataLoader) or (inputs, labels) tensor pairs."""
    return Digits(train=True), Digits(train=False)


if __name__ == "__main__":
    from mixprec.bench import compare
    from mixprec.train import fit

    result = fit(make_model, make_data, precision="bf16-mixed", epochs=2, lr=0.05, momentum=0.9, log_every=0)
    print(result.summary["test_accuracy"])
    comparison = compare(make_model, make_data, precisions=["fp32", "bf16-mixed"], repeats=2, epochs=2,
                         lr=0.05, momentum=0.9, out="runs/own-model")
    print(comparison.table())
