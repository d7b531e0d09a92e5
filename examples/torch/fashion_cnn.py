"""A PyTorch CNN on Fashion-MNIST trained by psd: run one of these per worker.

    python3 examples/torch/fashion_cnn.py tcp://127.0.0.1:5555 [--threads 1] [--device cuda] [--autocast]

with psd started on examples/torch/fashion_cnn.yaml (sh deploy/quickstart.sh torch does
both, with 2 workers). The data are Debian's dataset-fashion-mnist files, read with numpy.
The model is the user's own: psd holds the weights and the optimizer (the config's);
this loop computes gradients and validates its part.
"""
import argparse
import gzip
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

import psd.torch as pst

FM = os.environ.get("PSD_FASHION_MNIST", "/usr/share/datasets/fashion-mnist")


def idx(path, header):
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8, offset=header)


def load(split):
    images = idx(os.path.join(FM, "%s-images-idx3-ubyte.gz" % split), 16).reshape(-1, 1, 28, 28)
    labels = idx(os.path.join(FM, "%s-labels-idx1-ubyte.gz" % split), 8)
    x = (torch.from_numpy(images.astype(np.float32)) / 255.0 - 0.2860) / 0.3530
    return x, torch.from_numpy(labels.astype(np.int64))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 5)
        self.conv2 = torch.nn.Conv2d(32, 64, 5)
        self.fc1 = torch.nn.Linear(1024, 256)
        self.fc2 = torch.nn.Linear(256, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)   # 24x24 -> 12x12
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)   # 8x8 -> 4x4
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint", nargs="?", help="psd's tcp://HOST:PORT (default: $PSD_ENDPOINT)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda[:N]: the model and batches on that GPU")
    ap.add_argument("--autocast", action="store_true", help="the forward under torch.autocast(bfloat16)")
    ap.add_argument("--no-shm", action="store_true", help="over tcp even on psd's host (bfloat16 on the wire)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)  # the first worker's initial values are the run's
    xtr, ytr = load("train")
    xte, yte = load("t10k")
    model = Net().to(a.device)
    w = pst.Worker(a.endpoint, model, train_size=len(ytr), test_size=len(yte), data_id="fashion-mnist-debian",
                   threads=a.threads, shared_memory=not a.no_shm)
    dev = torch.device(a.device).type

    def evaluate(split, ids):
        x, y = (xtr, ytr) if split == "val" else (xte, yte)
        xs, ys = x[ids].to(a.device), y[ids].to(a.device)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=a.autocast):
            out = model(xs)
            loss = F.cross_entropy(out, ys, reduction="sum")
        return {"loss": loss.item(), "correct": int((out.argmax(1) == ys).sum()), "count": len(ids)}

    for epoch in w.epochs():
        model.train()
        for ids in w.batches():
            xs, ys = xtr[ids].to(a.device), ytr[ids].to(a.device)
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=a.autocast):  # mixed precision, if asked
                out = model(xs)
                loss = F.cross_entropy(out, ys, reduction="sum")
            # backward, each layer's gradient to psd as soon as it is computed, then the step
            w.backward(loss / len(ids), loss_sum=loss.item(), batch=len(ids), correct=int((out.argmax(1) == ys).sum()))
        model.eval()
        w.validate(evaluate)
        w.log("epoch %d done" % (epoch + 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
