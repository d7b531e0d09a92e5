"""Bandwidths that bound a synchronous GPU step through host memory (issue 64): pinned
host-to-device and device-to-host copies and a host memcpy, of BYTES (default 80 MB: the
MLP 784-4096-4096-10's gradient), medians of 10. One JSON line, GB/s.

    python3 bench/torch_bw.py [--device cuda] [--bytes 80150568]
"""
import argparse
import json
import statistics
import time

import torch


def median_s(fn, sync, n=10):
    ts = []
    for _ in range(n + 2):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[2:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--bytes", type=int, default=80150568)
    a = ap.parse_args()
    n = a.bytes // 4
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    h1 = torch.ones(n, pin_memory=cuda)
    h2 = torch.empty(n, pin_memory=cuda)
    d = torch.empty(n, device=dev)
    gb = a.bytes / 1e9
    out = {"bytes": a.bytes,
           "h2d_GBps": gb / median_s(lambda: d.copy_(h1, non_blocking=True), sync),
           "d2h_GBps": gb / median_s(lambda: h2.copy_(d, non_blocking=True), sync),
           "memcpy_GBps": gb / median_s(lambda: h2.copy_(h1), lambda: None)}
    if cuda:
        out["gpu"] = torch.cuda.get_device_name(dev)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
