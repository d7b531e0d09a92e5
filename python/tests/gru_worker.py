"""A torch worker for the log tests: a GRU over short random sequences
and a wide head, 8 tensors whose sizes make psd lay them out in 3 units
with gaps between them (psd's figures must be the model's, not its units'),
on its own data of N train and M test samples drawn from a seed. Prints
"world W" as soon as Worker() returns, then "rank R epoch E done (world W)"
after each epoch.

    gru_worker.py ENDPOINT [--train N] [--test M]
"""
import argparse
import sys

import torch
import torch.nn.functional as F

import psd.torch as pst

STEPS, INPUT, HIDDEN, WIDE, CLASSES = 4, 5, 7, 10000, 3


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # gru.*: 105 + 147 + 21 + 21 floats (one unit), wide.weight 70000 (a unit alone: at least
        # 65536), wide.bias 10000 + out.weight 30000 + out.bias 3 (one unit): 110297 parameters
        self.gru = torch.nn.GRU(INPUT, HIDDEN, batch_first=True)
        self.wide = torch.nn.Linear(HIDDEN, WIDE)
        self.out = torch.nn.Linear(WIDE, CLASSES)

    def forward(self, x):
        _, h = self.gru(x)
        return self.out(F.relu(self.wide(h[-1])))


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, STEPS, INPUT, generator=g)
    return x, (x.sum(1)[:, :CLASSES]).argmax(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("--train", type=int, default=256)
    ap.add_argument("--test", type=int, default=64)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net()
    xtr, ytr = data(a.train, 1)
    xte, yte = data(a.test, 2)
    w = pst.Worker(a.endpoint, model, train_size=a.train, test_size=a.test, data_id="gru-v1", verbose=True)
    print("world %d" % w.world, flush=True)

    def evaluate(split, idx):
        x, y = (xtr, ytr) if split == "val" else (xte, yte)
        out = model(x[idx])
        return {"loss": F.cross_entropy(out, y[idx], reduction="sum").item(),
                "correct": int((out.argmax(1) == y[idx]).sum()), "count": len(idx)}

    for epoch in w.epochs():
        for batch in w.batches():
            x, y = xtr[batch], ytr[batch]
            out = model(x)
            loss = F.cross_entropy(out, y, reduction="sum")
            (loss / len(batch)).backward()
            w.step(loss_sum=loss.item(), batch=len(batch), correct=int((out.argmax(1) == y).sum()))
        w.validate(evaluate)
        w.log("rank %d epoch %d done (world %d)" % (w.rank, epoch, w.world))
    return 0


if __name__ == "__main__":
    sys.exit(main())
