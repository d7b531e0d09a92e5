"""A torch worker for the tests: a small MLP on a synthetic task (labels
from a fixed random linear map of the inputs), its own data of N train and
M test samples drawn from a seed. Prints its rank's figures at the end.

    mlp_worker.py ENDPOINT [--train N] [--test M] [--data-id S] [--verbose] [--optimizer] [--slow S]
"""
import argparse
import sys
import time

import torch
import torch.nn.functional as F

import psd.torch as pst


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)
        self.tag = "mine"              # an attribute of the user's own

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))

    def describe(self):                # a method of the user's own
        return "Net(%s)" % self.tag


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(99))
    return x, (x @ w).argmax(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--test", type=int, default=500)
    ap.add_argument("--data-id", default="synthetic-v1")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--optimizer", action="store_true", help="also step a torch optimizer (refused)")
    ap.add_argument("--slow", type=float, default=0, help="seconds to sleep a step")
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net()
    xtr, ytr = data(a.train, 1)
    xte, yte = data(a.test, 2)
    w = pst.Worker(a.endpoint, model, train_size=a.train, test_size=a.test, data_id=a.data_id, verbose=a.verbose)
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if a.optimizer else None

    def evaluate(split, idx):
        x, y = (xtr, ytr) if split == "val" else (xte, yte)
        out = model(x[idx])
        return {"loss": F.cross_entropy(out, y[idx], reduction="sum").item(),
                "correct": int((out.argmax(1) == y[idx]).sum()), "count": len(idx),
                "abs_err": float((out.argmax(1) - y[idx]).abs().sum())}

    for epoch in w.epochs():
        for idx in w.batches():
            model.zero_grad()
            out = model(xtr[idx])
            loss = F.cross_entropy(out, ytr[idx], reduction="sum")
            (loss / len(idx)).backward()
            if opt:
                opt.step()
            if a.slow:
                time.sleep(a.slow)
            w.step(loss_sum=loss.item(), batch=len(idx), correct=int((out.argmax(1) == ytr[idx]).sum()))
        w.validate(evaluate)
        w.log("rank %d epoch %d done (world %d)" % (w.rank, epoch, w.world))
    assert isinstance(model, Net) and model.tag == "mine" and model.describe() == "Net(mine)"
    w.log("model intact: %s" % model.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
