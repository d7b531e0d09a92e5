#!/usr/bin/python3
"""A psd.torch worker over tcp with a large model, for bench/torch_keep_memory.sh:
the MLP 784-4096-4096-10 (80 MB of float32 parameters) on N random inputs,
one thread, no shared memory (the weights come over the wire). Prints the
milliseconds a step.

    PYTHONPATH=python PSD_WORKER_LIB=build/libpsworker.so.3 /usr/bin/python3 \\
        bench/torch_big_worker.py tcp://127.0.0.1:5555 N KEEP     (KEEP: 1 or 0)
"""
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import psd.torch as pst


def main():
    endpoint, n, keep = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))
    x, y = torch.randn(n, 784), torch.randint(0, 10, (n,))
    w = pst.Worker(endpoint, model, train_size=n, test_size=64, shared_memory=False, threads=1, keep_memory=keep)
    t0, steps = time.perf_counter(), 0
    for _ in w.epochs():
        for ids in w.batches():
            model.zero_grad()
            loss = F.cross_entropy(model(x[ids]), y[ids], reduction="sum")
            (loss / len(ids)).backward()
            w.step(loss_sum=loss.item(), batch=len(ids), correct=0)
            steps += 1
        w.validate(lambda split, ids: {"loss": 0.0, "correct": 0, "count": len(ids)})
    print("keep_memory %s: %d steps, %.1f ms a step" % (keep, steps, (time.perf_counter() - t0) / steps * 1e3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
