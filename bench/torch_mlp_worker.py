#!/usr/bin/python3
"""bench/bench_mlp.sh's MLP as a PyTorch model trained by psd, for bench/torch_mlp.sh.

    PYTHONPATH=python PSD_WORKER_LIB=build/libpsworker.so.3 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \\
        /usr/bin/python3 bench/torch_mlp_worker.py tcp://127.0.0.1:5555 [--threads 1]

with psd on model.kind from_worker. The model: 784-256-128-10, ReLU between the
layers (torch_ddp_mlp.py's build_mlp, an nn.Sequential: tensors 0.weight,
0.bias, 2.weight, ...), initial weights from torch.manual_seed(0). The data:
Fashion-MNIST read with numpy by examples/torch/fashion_cnn.py's load()
(the example's normalisation), flattened to N x 784. The loop: the example's
(bench/torch_cnn_worker.py's train(): the same statements, timed, a TIMING line
at the end).
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch_cnn_worker as W  # noqa: E402  (examples/torch on sys.path, psd.torch imported)
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import fashion_cnn  # noqa: E402


def mlp(layers=(784, 256, 128, 10)):
    """torch_ddp_mlp.py's build_mlp (not imported: that module sets thread
    variables at import)."""
    mods = []
    for i in range(len(layers) - 1):
        mods.append(nn.Linear(layers[i], layers[i + 1]))
        if i < len(layers) - 2:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)  # the first worker's initial values are the run's
    xtr, ytr = fashion_cnn.load("train")
    xte, yte = fashion_cnn.load("t10k")
    xtr, xte = xtr.reshape(-1, 784).contiguous(), xte.reshape(-1, 784).contiguous()
    return W.train(a.endpoint, mlp(), xtr, ytr, xte, yte, a.threads, "fashion-mnist-debian")


if __name__ == "__main__":
    sys.exit(main())
