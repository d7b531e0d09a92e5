"""A torch worker that offers psd its optimizer and scheduler (replay_cases.py's
CASE) and records what a plain-PyTorch replay needs: the initial weights
(OUT/init.pt) and each stepped batch's epoch and sample ids, in order
(OUT/ids.jsonl). psd writes the final weights (its --save).

    replay_worker.py ENDPOINT CASE OUT

CASE "plateau": a ReduceLROnPlateau, which psd does not run (the Worker refuses it).
The loop is a user's: it steps the scheduler (psd ignores that: psd runs its own
copy) and never the optimizer.
"""
import json
import os
import sys
import warnings

import torch
import torch.nn.functional as F

import psd.torch as pst
from replay_cases import BATCH, TEST, TRAIN, Net, build, data


def main():
    endpoint, case, out = sys.argv[1:4]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net()
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(out, "init.pt"))
    if case == "plateau":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched, interval, clip = torch.optim.lr_scheduler.ReduceLROnPlateau(opt), "epoch", None
    else:
        opt, sched, interval, clip = build(case, model)
    xtr, ytr = data(TRAIN, 1)
    xte, yte = data(TEST, 2)
    w = pst.Worker(endpoint, model, train_size=TRAIN, test_size=TEST, data_id="replay-v1", optimizer=opt,
                   scheduler=sched, scheduler_interval=interval, clip_norm=clip)
    assert w.batch_size == BATCH, w.batch_size
    warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")  # stepped without opt.step(): psd steps

    def evaluate(split, idx):
        o = model(xte[idx])
        return {"loss": F.cross_entropy(o, yte[idx], reduction="sum").item(),
                "correct": int((o.argmax(1) == yte[idx]).sum()), "count": len(idx)}

    ids = open(os.path.join(out, "ids.jsonl"), "w")
    for epoch in w.epochs():
        for idx in w.batches():
            o = model(xtr[idx])
            loss = F.cross_entropy(o, ytr[idx])  # the batch's mean
            loss.backward()
            w.step(loss_sum=loss.item() * len(idx), batch=len(idx), correct=int((o.argmax(1) == ytr[idx]).sum()))
            ids.write(json.dumps([epoch, idx]) + "\n")
            ids.flush()
            if sched is not None and interval == "step":
                sched.step()
        w.validate(evaluate)
        if sched is not None and interval == "epoch":
            sched.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
