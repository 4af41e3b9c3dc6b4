"""A user's own code, as `mixprec --model tests.userpkg.factories:...` would import it (tests only)."""

import torch
from torch import nn
from torch.utils.data import Dataset

from mixprec.train.data import load_dataset


class UserCNN(nn.Module):
    def __init__(self, channels: int, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.MaxPool2d(2))
        self.head = nn.Linear(8 * 4 * 4, num_classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def cnn(input_shape, num_classes):
    return UserCNN(input_shape[0], num_classes)


class UserTransformer(nn.Module):
    """Rows of the 8x8 image as 8 tokens of 8 features; a pre-norm encoder; mean-pooled head."""

    def __init__(self, d_in: int, num_classes: int, d_model: int = 32):
        super().__init__()
        self.embed = nn.Linear(d_in, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x):
        tokens = self.embed(x.flatten(1, 2) if x.dim() == 4 else x)
        return self.head(self.encoder(tokens).mean(1))


def transformer(input_shape, num_classes, **_):
    return UserTransformer(input_shape[-1], num_classes)


def wrong_output(input_shape):
    return nn.Linear(input_shape[-1], 3)  # ignores num_classes and the image shape


def not_a_module(num_classes):
    return {"classes": num_classes}


def raises(num_classes):
    raise ValueError("width must be even")


def digits_tensors():
    d = load_dataset("digits")
    return (d.x_train, d.y_train), (d.x_test, d.y_test)


class DigitsDataset(Dataset):
    """The same digits as a map-style dataset: one (image, label) per __getitem__."""

    def __init__(self, train: bool):
        d = load_dataset("digits")
        self.x, self.y = (d.x_train, d.y_train) if train else (d.x_test, d.y_test)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def digits_datasets():
    return DigitsDataset(True), DigitsDataset(False)


def empty():
    x = torch.zeros(0, 1, 8, 8)
    y = torch.zeros(0, dtype=torch.long)
    return (x, y), (x, y)


def not_a_pair():
    return DigitsDataset(True)


def float_labels():
    (x, y), (xt, yt) = digits_tensors()
    return (x, y.float()), (xt, yt.float())


def smooth_l1(outputs, targets):
    return nn.functional.cross_entropy(outputs, targets) * 1.0


def not_scalar(outputs, targets):
    return nn.functional.cross_entropy(outputs, targets, reduction="none")
