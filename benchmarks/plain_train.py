"""The tutorial's training script, written plainly: what `mixprec train` is compared with in whole_run.py.

Same work as `mixprec train --model mlp --precision P --dataset fashion-mnist` with its defaults: the IDX files
from the Debian package, the same MLP, SGD, a test evaluation after every epoch, and the tutorial's table
at the end; torch.autocast + GradScaler (enabled for fp16 only). No checkpoints, no memory accounting.
"""

import argparse
import gzip
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

D = "/usr/share/datasets/fashion-mnist"


def idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims).copy())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--precision", default="bf16-mixed", choices=["fp32", "bf16-mixed", "fp16-mixed"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=512)
    a = p.parse_args()
    torch.manual_seed(0)
    x = (idx(f"{D}/train-images-idx3-ubyte.gz").float().unsqueeze(1) / 255 - 0.5) / 0.5
    y = idx(f"{D}/train-labels-idx1-ubyte.gz").long()
    xt = (idx(f"{D}/t10k-images-idx3-ubyte.gz").float().unsqueeze(1) / 255 - 0.5) / 0.5
    yt = idx(f"{D}/t10k-labels-idx1-ubyte.gz").long()
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, a.width), nn.ReLU(), nn.Linear(a.width, a.width), nn.ReLU(),
                          nn.Linear(a.width, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dtype = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}[a.precision]
    scaler = torch.amp.GradScaler("cpu", enabled=dtype is torch.float16)
    for epoch in range(a.epochs):
        t0 = time.perf_counter()
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for i in range(0, len(x), a.batch_size):
            b = perm[i:i + a.batch_size]
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = F.cross_entropy(model(x[b]), y[b])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if not (i // a.batch_size) % 100:
                print(f"Epoch: {epoch}, Batch: {i // a.batch_size}, Loss: {loss.item():.4f}")
        dt = time.perf_counter() - t0
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            acc = sum((model(xt[j:j + 1000]).argmax(1) == yt[j:j + 1000]).sum().item() for j in range(0, len(xt), 1000))
        print(f"epoch {epoch}: {dt:.2f} s, test accuracy {100 * acc / len(xt):.2f}%")


if __name__ == "__main__":
    sys.exit(main())
