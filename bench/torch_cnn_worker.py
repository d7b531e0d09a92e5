#!/usr/bin/python3
"""examples/torch/fashion_cnn.py's worker with timing, for bench/torch_cnn.sh.

    PYTHONPATH=python PSD_WORKER_LIB=build/libpsworker.so.3 \\
        /usr/bin/python3 bench/torch_cnn_worker.py tcp://127.0.0.1:5555 [--threads 1]

The example's own Net and load() (imported from examples/torch, not copied)
and its training loop (the same statements; the loss and accuracy taken
before w.step() rather than in its arguments), with clocks around it. At the
end one line on stdout:

    TIMING {"wait_s": .., "train_s": .., "steps": .., "loop_s": .., "compute_s": .., "own_wait_s": .., ...}

wait_s, train_s, steps: the psd.torch.Worker's own counters (seconds blocked on
psd while training: push, waiting for the next weights, the barrier; seconds
inside its batches() loops, the user's compute included; steps), null where
this psd.torch has none yet. loop_s, compute_s, own_wait_s, own_steps: this
script's clocks around the same loops: loop_s from entering batches() to its
end, compute_s the loop bodies up to w.step() (forward, backward, the loss
and accuracy), own_wait_s = loop_s - compute_s (w.step() and the generator's
waits: the push, the next weights and their copy into the parameters, the
epoch's last barrier). Validation is outside all of them.

bench/torch_mlp_worker.py runs this loop on its MLP (train()).
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "torch"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fashion_cnn  # noqa: E402  (imports psd.torch: PYTHONPATH must hold python/)
import psd.torch as pst  # noqa: E402


def openblas_core():
    try:
        import ctypes
        lib = ctypes.CDLL("libopenblas.so.0")
        lib.openblas_get_corename.restype = ctypes.c_char_p
        return lib.openblas_get_corename().decode()
    except (OSError, AttributeError):
        return None


def train(endpoint, model, xtr, ytr, xte, yte, threads, data_id):
    """fashion_cnn.py's main() loop on model, timed; prints TIMING."""
    w = pst.Worker(endpoint, model, train_size=len(ytr), test_size=len(yte), data_id=data_id, threads=threads)
    print("rank %d: OpenBLAS core %s (OPENBLAS_CORETYPE=%s), %d torch thread(s)"
          % (w.rank, openblas_core(), os.environ.get("OPENBLAS_CORETYPE", "unset"), torch.get_num_threads()),
          file=sys.stderr, flush=True)

    def evaluate(split, ids):
        x, y = (xtr, ytr) if split == "val" else (xte, yte)
        out = model(x[ids])
        return {"loss": F.cross_entropy(out, y[ids], reduction="sum").item(),
                "correct": int((out.argmax(1) == y[ids]).sum()), "count": len(ids)}

    clock = time.perf_counter
    loop_s = compute_s = 0.0
    own_steps = epochs = 0
    for epoch in w.epochs():
        model.train()
        t_loop = clock()
        for ids in w.batches():
            t0 = clock()
            model.zero_grad()
            out = model(xtr[ids])
            loss = F.cross_entropy(out, ytr[ids], reduction="sum")
            (loss / len(ids)).backward()
            loss_sum, correct = loss.item(), int((out.argmax(1) == ytr[ids]).sum())
            compute_s += clock() - t0
            w.step(loss_sum=loss_sum, batch=len(ids), correct=correct)
            own_steps += 1
        loop_s += clock() - t_loop
        epochs += 1
        model.eval()
        w.validate(evaluate)
        w.log("epoch %d done" % (epoch + 1))
    timing = {"rank": w.rank, "wait_s": getattr(w, "wait_s", None), "train_s": getattr(w, "train_s", None),
              "steps": getattr(w, "steps", None), "loop_s": round(loop_s, 6), "compute_s": round(compute_s, 6),
              "own_wait_s": round(loop_s - compute_s, 6), "own_steps": own_steps, "epochs": epochs,
              "openblas_core": openblas_core()}
    print("TIMING " + json.dumps(timing), flush=True)
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)  # the first worker's initial values are the run's
    xtr, ytr = fashion_cnn.load("train")
    xte, yte = fashion_cnn.load("t10k")
    return train(a.endpoint, fashion_cnn.Net(), xtr, ytr, xte, yte, a.threads, "fashion-mnist-debian")


if __name__ == "__main__":
    sys.exit(main())
