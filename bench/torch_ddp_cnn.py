#!/usr/bin/python3
"""PyTorch reference benchmark for psd: data-parallel CNN on Fashion-MNIST.

The counterpart of examples/torch/fashion_cnn.py trained by psd (bench/torch_cnn.sh
runs both). Run with Debian's torch (the `python3` on PATH may not have torch):

    /usr/bin/python3 bench/torch_ddp_cnn.py                     # 2 procs, DDP/gloo, 10 epochs, onecycle
    /usr/bin/python3 bench/torch_ddp_cnn.py --epochs 1 --train-limit 4096
    /usr/bin/python3 bench/torch_ddp_cnn.py --schedule constant

What it does
  * The model is examples/torch/fashion_cnn.py's Net itself (imported, not
    copied): conv 1->32 5x5, max-pool 2, conv 32->64 5x5, max-pool 2,
    fc 1024->256, fc 256->10, ReLU; initial weights from torch.manual_seed(0)
    as the example's (the first psd worker's values are psd's run's).
  * Data: the Fashion-MNIST IDX files read and checked by torch_ddp_mlp.py's
    readers, x = (pixel/255 - 0.2860) / 0.3530 (the example's), shaped
    N x 1 x 28 x 28. --train-limit K trains on the first K samples only (psd's
    data.train_limit).
  * Optimizer: SGD lr --lr, momentum 0.9, weight decay 5e-4, Nesterov on: what
    psd does with examples/torch/fashion_cnn.yaml (psd's optimizer.nesterov
    defaults to true; its update is PyTorch's SGD with nesterov=True, weight
    decay added to the gradient, on every tensor).
  * Schedule: --schedule onecycle (default) is psd's onecycle
    (server/psd_optim.c onecycle_lr, PyTorch OneCycleLR's cosine form):
    total = epochs * spe steps, spe = ceil(ceil(T / procs) / batch) as psd
    counts it (T training samples), start lr/div_factor, peak lr at step
    pct_start*total - 1, end lr/div_factor/final_div_factor at step total-1;
    step s of the run (0-based, epoch*spe + step in the epoch) takes lr(s).
    --schedule constant: lr throughout.
  * --procs N > 1: DistributedDataParallel, gloo, 127.0.0.1, a free port; every
    epoch a permutation seeded by seed+epoch split perm[rank::N] (as
    torch_ddp_mlp.py); the mean gradient of the global batch (N x --batch).
    DDP's join() (uneven parts) only where the ranks' batch counts differ
    (--join always: every epoch, as torch_ddp_mlp.py).
    --procs 1: one plain process.
  * Timing: training loops only (start-up, data loading and the test excluded):
    rank 0 times each epoch between a dist.barrier() before its loop and one
    after it. samples_per_s = T * epochs / sum(epoch training times).
  * After the last epoch rank 0 tests the final weights on all 10000 test
    samples (exact accuracy and mean cross-entropy).
  * Last line: `RESULT {json}` with keys impl, model, procs, epochs, batch,
    train_samples, schedule, lr, epoch_lr (each epoch's last lr, as psd's
    metrics lines' "lr"), samples_per_s, train_s, test_acc, test_loss,
    openblas_core, torch_version.

Threads: one per process (torch.set_num_threads(1); OPENBLAS_NUM_THREADS=1 and
OMP_NUM_THREADS=1 are set by torch_ddp_mlp.py's import before torch loads);
OPENBLAS_CORETYPE, when set in the environment, is inherited.
"""
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "torch"))

import torch_ddp_mlp as M  # noqa: E402  (sets OPENBLAS_NUM_THREADS/OMP_NUM_THREADS before torch)

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def net_class():
    """examples/torch/fashion_cnn.py's Net. The example imports psd.torch at
    its top; without PYTHONPATH to python/ a stand-in module is put in its
    place (the DDP run never uses it)."""
    try:
        import fashion_cnn
    except ImportError as e:
        if "psd" not in str(e):
            raise
        import types
        pkg = types.ModuleType("psd")
        pkg.torch = types.ModuleType("psd.torch")
        sys.modules.setdefault("psd", pkg)
        sys.modules.setdefault("psd.torch", pkg.torch)
        import fashion_cnn
    return fashion_cnn.Net


def onecycle_lr(s, spe, epochs, lr, pct_start, div_factor, final_div_factor):
    """psd's onecycle_lr (server/psd_optim.c), step s of the run."""
    def cos_anneal(a, b, pct):
        pct = min(max(pct, 0.0), 1.0)
        return b + (a - b) / 2.0 * (1.0 + math.cos(math.pi * pct))
    total = float(epochs) * spe
    initial = lr / div_factor
    final = initial / final_div_factor
    e1 = pct_start * total - 1.0
    e2 = total - 1.0
    if s <= e1:
        return cos_anneal(initial, lr, s / e1 if e1 > 0.0 else 1.0)
    pct = (s - e1) / (e2 - e1) if e2 - e1 > 0.0 else 1.0
    return cos_anneal(lr, final, pct)


def load(data_dir, train_limit):
    p = lambda name: os.path.join(data_dir, name)  # noqa: E731
    xtr = M._normalise(M.read_idx_images(p(M.TRAIN_IMAGES), 60000)).view(-1, 1, 28, 28)
    ytr = torch.from_numpy(M.read_idx_labels(p(M.TRAIN_LABELS), 60000).astype("int64"))
    xte = M._normalise(M.read_idx_images(p(M.TEST_IMAGES), 10000)).view(-1, 1, 28, 28)
    yte = torch.from_numpy(M.read_idx_labels(p(M.TEST_LABELS), 10000).astype("int64"))
    if train_limit:
        xtr, ytr = xtr[:train_limit], ytr[:train_limit]
    return xtr, ytr, xte, yte


def run_worker(rank, args, port):
    world = args.procs
    ddp = world > 1
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    if ddp:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)

    xtr, ytr, xte, yte = load(args.data_dir, args.train_limit)
    n_train = xtr.shape[0]
    torch.manual_seed(args.init_seed)  # the example's initial weights (DDP also broadcasts rank 0's)
    net = net_class()()
    model = nn.parallel.DistributedDataParallel(net) if ddp else net
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                          nesterov=args.nesterov)
    spe = -(-(-(-n_train // world)) // args.batch)  # ceil(ceil(T / N) / batch): psd's steps per epoch
    # DDP's join() (for ranks with different numbers of batches) costs an extra
    # all-reduce every step: used only where the parts' batch counts differ
    uneven = any(-(-len(range(r, n_train, world)) // args.batch) != spe for r in range(world))

    def lr_at(s):
        if args.schedule == "constant":
            return args.lr
        return onecycle_lr(s, spe, args.epochs, args.lr, args.pct_start, args.div_factor, args.final_div_factor)

    ob = M.openblas_info()
    if rank == 0:
        nparams = sum(p.numel() for p in net.parameters())
        M._log("model: fashion_cnn Net (%d params), SGD lr=%g momentum=%g weight_decay=%g nesterov=%s, "
               "schedule %s (%d steps/epoch), batch %d/proc, %d training samples"
               % (nparams, args.lr, args.momentum, args.weight_decay, args.nesterov, args.schedule, spe,
                  args.batch, n_train))
        M._log("mode: %s, %d proc(s) x 1 thread, torch %s"
               % ("DDP gloo 127.0.0.1:%d" % port if ddp else "single process (no DDP)", world, torch.__version__))
        M._log("openblas: %s (OPENBLAS_CORETYPE=%s)"
               % ("core %s [%s]" % ob if ob else "not found", os.environ.get("OPENBLAS_CORETYPE", "unset")))

    train_s = 0.0
    step = 0
    epoch_lr = []  # the lr of each epoch's last step (psd's metrics lines' "lr")
    for epoch in range(args.epochs):
        idx = M.epoch_part(n_train, args.seed, epoch, rank, world)
        model.train()
        loss_sum = 0.0
        i = 0
        if ddp:
            dist.barrier()
        t0 = time.perf_counter()
        with (model.join() if ddp and (uneven or args.join == "always") else _null()):
            for s in range(0, idx.numel(), args.batch):
                b = idx[s:s + args.batch]
                for g in opt.param_groups:
                    g["lr"] = lr_at(epoch * spe + i)
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(xtr.index_select(0, b)), ytr.index_select(0, b))
                loss.backward()
                opt.step()
                loss_sum += loss.item() * b.numel()
                i += 1
        if ddp:
            dist.barrier()
        dt = time.perf_counter() - t0
        step += i
        train_s += dt
        epoch_lr.append(opt.param_groups[0]["lr"])
        stats = torch.tensor([loss_sum, float(idx.numel())], dtype=torch.float64)
        if ddp:
            dist.all_reduce(stats)  # reporting only, outside the timed region
        if rank == 0:
            M._log("epoch %d/%d: train_loss %.4f  samples %d  time %.3fs  %.0f samples/s  lr %.6g"
                   % (epoch + 1, args.epochs, stats[0].item() / stats[1].item(), int(stats[1].item()), dt,
                      stats[1].item() / dt, opt.param_groups[0]["lr"]))

    if rank == 0:
        acc, tloss = M.evaluate(net, xte, yte)
        sps = n_train * args.epochs / train_s
        M._log("test: acc %.4f  loss %.4f  (10000 samples)" % (acc, tloss))
        M._log("train: %d samples in %.3fs -> %.0f samples/s" % (n_train * args.epochs, train_s, sps))
        M._log("RESULT " + json.dumps({
            "impl": "pytorch-ddp-gloo" if ddp else "pytorch-single", "model": "fashion_cnn", "procs": world,
            "epochs": args.epochs, "batch": args.batch, "train_samples": n_train, "schedule": args.schedule,
            "lr": args.lr, "epoch_lr": epoch_lr, "samples_per_s": round(sps, 1), "train_s": round(train_s, 4), "test_acc": acc,
            "test_loss": round(tloss, 6), "openblas_core": ob[0] if ob else None,
            "torch_version": torch.__version__}))
    if ddp:
        dist.barrier()  # keep the peers until rank 0 has tested
        dist.destroy_process_group()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--procs", type=int, default=2, help="processes (DDP/gloo when > 1; 1 = one plain process)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64, help="minibatch per process")
    ap.add_argument("--lr", type=float, default=0.05, help="the lr (onecycle: its peak)")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    ap.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--schedule", choices=("onecycle", "constant"), default="onecycle")
    ap.add_argument("--pct-start", type=float, default=0.25)
    ap.add_argument("--div-factor", type=float, default=25.0)
    ap.add_argument("--final-div-factor", type=float, default=1e4)
    ap.add_argument("--seed", type=int, default=42, help="data order")
    ap.add_argument("--init-seed", type=int, default=0, help="torch.manual_seed before the model (the example's 0)")
    ap.add_argument("--train-limit", type=int, default=0, help="train on the first K samples; 0: all 60000")
    ap.add_argument("--join", choices=("auto", "always"), default="auto",
                    help="DDP's join() context (an extra all-reduce a step): auto = only where the ranks' parts "
                         "have different numbers of batches (torch_ddp_mlp.py: always)")
    ap.add_argument("--data-dir", default=M.DEFAULT_DATA_DIR)
    args = ap.parse_args(argv)
    if args.procs < 1 or args.epochs < 1 or args.batch < 1 or not 0 <= args.train_limit <= 60000:
        ap.error("--procs, --epochs and --batch must be >= 1, --train-limit 0 to 60000")
    for name in (M.TRAIN_IMAGES, M.TRAIN_LABELS, M.TEST_IMAGES, M.TEST_LABELS):
        if not os.path.isfile(os.path.join(args.data_dir, name)):
            ap.error("missing %s in %s (use --data-dir)" % (name, args.data_dir))
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.procs == 1:
        run_worker(0, args, 0)
        return 0
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    mp.spawn(run_worker, args=(args, M.free_port()), nprocs=args.procs, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
