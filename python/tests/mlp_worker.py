"""A torch worker for the tests: a small MLP on a synthetic task (labels
from a fixed random linear map of the inputs), its own data of N train and
M test samples drawn from a seed. Prints its rank's figures at the end.

    mlp_worker.py ENDPOINT [--train N] [--test M] [--data-id S] [--verbose] [--optimizer] [--slow S]
                  [--loader K] [--ids FILE] [--set-to-none] [--no-shm] [--raise-at N] [--exit-at N]
                  [--batch-figure B] [--last-val FILE] [--end-run-after E]

--loader K: the batches come from a DataLoader (w.sampler(), K reader processes); --ids FILE:
each stepped batch's epoch and sample ids, a line each, written before the next batch.
--raise-at N: the loop raises ValueError at its Nth step (a bug of the user's: the worker
fails); --exit-at N: the script returns at its Nth step, still in the run; --batch-figure B:
w.step(batch=B), a wrong figure psd refuses; --last-val FILE: psd's figures of its last validation
(the session's last_val) after each epoch and at the end, a JSON line each; --end-run-after E: after
epoch E's validation the worker ends the run (w._s.end_run) and returns.
"""
import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

import psd.torch as pst


class Net(torch.nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, hidden)
        self.fc2 = torch.nn.Linear(hidden, 4)
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
    ap.add_argument("--loader", type=int, default=-1, help="a DataLoader with this many reader processes")
    ap.add_argument("--ids", help="write each stepped batch's epoch and ids here")
    ap.add_argument("--set-to-none", action="store_true", help="model.zero_grad(set_to_none=True) each batch")
    ap.add_argument("--no-shm", action="store_true")
    ap.add_argument("--staging", action="store_true", help="the device path on CPU tensors (host buffers, hooks)")
    ap.add_argument("--early", action="store_true", help="w.backward(): each layer pushed once computed")
    ap.add_argument("--autocast", action="store_true", help="the forward under torch.autocast(bfloat16)")
    ap.add_argument("--raise-at", type=int, default=0)
    ap.add_argument("--exit-at", type=int, default=0)
    ap.add_argument("--batch-figure", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=32, help="the hidden layer's width")
    ap.add_argument("--retry-s", type=float, default=120.0, help="how long to register again after psd is lost")
    ap.add_argument("--last-val", help="write psd's last validation figures here after each epoch")
    ap.add_argument("--end-run-after", type=int, default=0, help="end the run after this epoch (1-based)")
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net(a.hidden)
    xtr, ytr = data(a.train, 1)
    xte, yte = data(a.test, 2)
    w = pst.Worker(a.endpoint, model, train_size=a.train, test_size=a.test, data_id=a.data_id, verbose=a.verbose,
                   shared_memory=not a.no_shm, staging=a.staging or None, retry_s=a.retry_s)
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if a.optimizer else None

    def evaluate(split, idx):
        x, y = (xtr, ytr) if split == "val" else (xte, yte)
        out = model(x[idx])
        return {"loss": F.cross_entropy(out, y[idx], reduction="sum").item(),
                "correct": int((out.argmax(1) == y[idx]).sum()), "count": len(idx),
                "abs_err": float((out.argmax(1) - y[idx]).abs().sum())}

    loader = None
    if a.loader >= 0:
        ds = torch.utils.data.TensorDataset(xtr, ytr, torch.arange(a.train))
        loader = torch.utils.data.DataLoader(ds, batch_sampler=w.sampler(), num_workers=a.loader)
    ids = open(a.ids, "w") if a.ids else None
    last_val = open(a.last_val, "w") if a.last_val else None
    n = 0
    gdtypes = set()  # the gradients' dtypes backward gave
    for epoch in w.epochs():
        for batch in w.batches(loader):
            n += 1
            if n == a.raise_at:
                raise ValueError("a bug in the user's loop at step %d" % n)
            if n == a.exit_at:
                return 0
            if loader is None:
                x, y, idx = xtr[batch], ytr[batch], batch
            else:
                x, y, idx = batch[0], batch[1], batch[2].tolist()
            if a.set_to_none:
                model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.autocast):
                out = model(x)
                loss = F.cross_entropy(out, y, reduction="sum")
            figures = dict(loss_sum=loss.item(), batch=a.batch_figure or len(idx),
                           correct=int((out.argmax(1) == y).sum()))
            if a.early:
                w.backward(loss / len(idx), **figures)
            else:
                (loss / len(idx)).backward()
                gdtypes.update(str(p.grad.dtype) for p in model.parameters() if p.grad is not None)
                if opt:
                    opt.step()
                if a.slow:
                    time.sleep(a.slow)
                w.step(**figures)
            if ids:
                ids.write(json.dumps([epoch, idx]) + "\n")
                ids.flush()
        w.validate(evaluate)
        w.log("rank %d epoch %d done (world %d)" % (w.rank, epoch, w.world))
        if last_val:
            last_val.write(json.dumps(w._s.last_val) + "\n")
            last_val.flush()
        if epoch + 1 == a.end_run_after:
            w._s.end_run("test")
            w.close()
            return 0
    if last_val:  # after the SHUTDOWN: the closing test's
        last_val.write(json.dumps(w._s.last_val) + "\n")
    assert isinstance(model, Net) and model.tag == "mine" and model.describe() == "Net(mine)"
    w.log("model intact: %s" % model.describe())
    w.log("copies %d rejoins %d steps %d dropped %d layer_pushes %d bytes_pushed %d exit_code %s" % (
        w.copies, w.rejoins, w.steps, w.dropped, w.layer_pushes, w.bytes_pushed, w.exit_code))
    if a.autocast:
        w.log("autocast: parameters %s, gradients %s" % (sorted({str(p.dtype) for p in model.parameters()}),
                                                          sorted(gdtypes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
