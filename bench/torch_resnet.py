"""The round behind the GPU's step (issue 64): a CIFAR-style ResNet-18 (3x3 stem, no
max-pool, 11.2M parameters) on synthetic 32x32 images, SGD with momentum, float32.

    python3 bench/torch_resnet.py plain --device cuda [--batch 256] [--steps 60]
    python3 bench/torch_resnet.py worker tcp://127.0.0.1:PORT --device cuda [--batch 256]

plain: one PyTorch process (torch.optim.SGD, lr 0.1, momentum 0.9). worker: a psd.torch
worker (psd on bench/resnet.yaml: the same optimizer on psd), each layer's gradient pushed
as backward computes it (w.backward). Both time the steps after --warmup and print one
JSON line: samples/s, ms a step, and for the worker the share of the step it waited for
psd. Not a test: nothing here passes or fails.
"""
import argparse
import json
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        return F.relu(y + (x if self.short is None else self.short(x)))


class ResNet18(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("plain", "worker"))
    ap.add_argument("endpoint", nargs="?")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60, help="timed steps (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--workers", type=int, default=1, help="(worker) the run's workers: sizes the data")
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True
    model = ResNet18().to(dev)
    nb = 8  # distinct synthetic batches, on the device
    xs = torch.randn(nb, a.batch, 3, 32, 32, device=dev)
    ys = torch.randint(0, 10, (nb, a.batch), device=dev)
    n_params = sum(p.numel() for p in model.parameters())
    total = a.warmup + a.steps
    if a.mode == "plain":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        t0 = None
        for i in range(total):
            if i == a.warmup:
                sync(dev)
                t0 = time.perf_counter()
            out = model(xs[i % nb])
            loss = F.cross_entropy(out, ys[i % nb])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sync(dev)
        dt = time.perf_counter() - t0
        print(json.dumps({"mode": "plain", "params": n_params, "batch": a.batch, "steps": a.steps,
                          "ms_per_step": 1000 * dt / a.steps, "samples_per_s": a.steps * a.batch / dt}))
        return 0
    import psd.torch as pst
    w = pst.Worker(a.endpoint, model, train_size=total * a.batch * a.workers, test_size=a.batch,
                   data_id="synthetic-resnet")
    n, t0, wait0 = 0, None, 0.0
    for epoch in w.epochs():
        model.train()
        for ids in w.batches():
            if n == a.warmup:
                sync(dev)
                t0 = time.perf_counter()
                wait0 = w.wait_s
            k = n % nb
            out = model(xs[k][:len(ids)])
            loss = F.cross_entropy(out, ys[k][:len(ids)], reduction="sum")
            w.backward(loss / len(ids), loss_sum=loss.item(), batch=len(ids), correct=0)
            n += 1
        sync(dev)
        dt = time.perf_counter() - t0 if t0 is not None else 0.0
        timed = n - a.warmup
        waited = w.wait_s - wait0
        model.eval()

        def evaluate(split, ids):
            with torch.no_grad():
                out = model(xs[0][:len(ids)])
                return {"loss": F.cross_entropy(out, ys[0][:len(ids)], reduction="sum").item(), "correct": 0,
                        "count": len(ids)}
        w.validate(evaluate)
    print(json.dumps({"mode": "worker", "rank": w.rank, "world": w.world, "params": n_params, "batch": a.batch,
                      "steps": timed, "ms_per_step": 1000 * dt / max(timed, 1),
                      "samples_per_s": timed * a.batch / dt if dt > 0 else 0,
                      "wait_share": waited / dt if dt > 0 else 0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
