#!/usr/bin/python3
"""PyTorch reference benchmark for psd: data-parallel MLP on Fashion-MNIST.

Run with Debian's torch (the `python3` on PATH may not have torch):

    /usr/bin/python3 bench/torch_ddp_mlp.py                 # 2 procs, DDP/gloo, 5 epochs
    /usr/bin/python3 bench/torch_ddp_mlp.py --procs 1       # single plain process, no DDP
    /usr/bin/python3 bench/torch_ddp_mlp.py --epochs 1 --layers 784,512,10

What it does
  * Reads the Fashion-MNIST IDX .gz files itself (gzip + numpy.frombuffer, the
    magic numbers and dimensions are checked); no torchvision, no downloads.
    Pixels are normalised as x = (pixel/255 - 0.2860) / 0.3530.
  * Model: MLP with --layers (default 784,256,128,10), ReLU between layers,
    cross-entropy loss, SGD(lr=--lr, momentum=--momentum), --batch samples
    per process per step.
  * --procs N > 1: N processes started with torch.multiprocessing, wrapped in
    DistributedDataParallel with the gloo backend on 127.0.0.1 (a free port is
    chosen by binding a socket to port 0). Every epoch a permutation seeded by
    seed+epoch is split DistributedSampler-style (perm[rank::N]) into N
    disjoint parts; nothing is dropped or duplicated (uneven parts are handled
    with DDP's join()).
  * --procs 1: one plain process without DDP/process group, same data order.
  * Timing: only the training loops are timed (start-up, data loading and
    evaluation are excluded). Rank 0 measures each epoch between a
    dist.barrier() before the loop and one after it.
    samples_per_s = 60000 * epochs / sum(epoch training times).
  * After the last epoch rank 0 evaluates the whole 10k test set (exact
    accuracy and mean cross-entropy over all 10000 samples).
  * Last line of output: `RESULT {json}` with keys impl, procs, epochs, batch,
    samples_per_s, train_s, test_acc, test_loss, torch_version.

Threads: every process runs with torch.set_num_threads(1). Debian's torch is
built with BLAS_INFO=generic and links libblas.so.3, which (via Debian's
alternatives) is OpenBLAS (the pthread variant). OpenBLAS keeps its own thread
pool and ignores torch.set_num_threads(), so OPENBLAS_NUM_THREADS=1 and
OMP_NUM_THREADS=1 are put into os.environ below *before* torch is imported
(spawned children inherit the environment). Without that each process would
start one BLAS thread per core and N processes would oversubscribe the CPU.

OpenBLAS kernels: OpenBLAS picks its GEMM kernels from CPUID at load time. On
some VMs (generic "Intel(R) Xeon(R) Processor" model) it falls back to the
ancient "Prescott" SSE3 kernels, roughly halving throughput of this MLP. The
script prints the core OpenBLAS chose; `--openblas-coretype Haswell` (or
SkylakeX, Zen, ...) sets OPENBLAS_CORETYPE before torch is loaded to override
it. By default nothing is overridden (an OPENBLAS_CORETYPE already in the
environment is respected).
"""

import os
import sys

# Must happen before `import torch` (see module docstring).
os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ["OMP_NUM_THREADS"] = "1"


def _early_openblas_coretype(argv):
    """--openblas-coretype must take effect before torch (and so OpenBLAS) is
    loaded, i.e. before argparse runs; pick it out of argv here."""
    for i, a in enumerate(argv):
        if a.startswith("--openblas-coretype="):
            return a.split("=", 1)[1]
        if a == "--openblas-coretype" and i + 1 < len(argv):
            return argv[i + 1]
    return None


if __name__ == "__main__":
    _ct = _early_openblas_coretype(sys.argv[1:])
    if _ct:
        os.environ["OPENBLAS_CORETYPE"] = _ct  # inherited by spawned workers

import argparse  # noqa: E402
import ctypes  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
TRAIN_IMAGES = "train-images-idx3-ubyte.gz"
TRAIN_LABELS = "train-labels-idx1-ubyte.gz"
TEST_IMAGES = "t10k-images-idx3-ubyte.gz"
TEST_LABELS = "t10k-labels-idx1-ubyte.gz"
MEAN = 0.2860
STD = 0.3530
IMAGE_MAGIC = 0x00000803  # unsigned byte, 3 dims
LABEL_MAGIC = 0x00000801  # unsigned byte, 1 dim


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------

def _read_gz(path):
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise SystemExit("error: cannot read %s: %s" % (path, e))


def read_idx_images(path, expect_n):
    buf = _read_gz(path)
    if len(buf) < 16:
        raise SystemExit("error: %s: truncated IDX header" % path)
    magic, n, rows, cols = np.frombuffer(buf, dtype=">u4", count=4, offset=0)
    if magic != IMAGE_MAGIC:
        raise SystemExit("error: %s: bad magic 0x%08x (want 0x%08x)"
                         % (path, magic, IMAGE_MAGIC))
    if n != expect_n or rows != 28 or cols != 28:
        raise SystemExit("error: %s: dims %dx%dx%d, want %dx28x28"
                         % (path, n, rows, cols, expect_n))
    if len(buf) != 16 + n * rows * cols:
        raise SystemExit("error: %s: payload is %d bytes, want %d"
                         % (path, len(buf) - 16, n * rows * cols))
    px = np.frombuffer(buf, dtype=np.uint8, offset=16).reshape(n, rows * cols)
    return px


def read_idx_labels(path, expect_n):
    buf = _read_gz(path)
    if len(buf) < 8:
        raise SystemExit("error: %s: truncated IDX header" % path)
    magic, n = np.frombuffer(buf, dtype=">u4", count=2, offset=0)
    if magic != LABEL_MAGIC:
        raise SystemExit("error: %s: bad magic 0x%08x (want 0x%08x)"
                         % (path, magic, LABEL_MAGIC))
    if n != expect_n:
        raise SystemExit("error: %s: %d labels, want %d" % (path, n, expect_n))
    if len(buf) != 8 + n:
        raise SystemExit("error: %s: payload is %d bytes, want %d"
                         % (path, len(buf) - 8, n))
    lab = np.frombuffer(buf, dtype=np.uint8, offset=8)
    if lab.max() > 9:
        raise SystemExit("error: %s: label %d out of range 0..9"
                         % (path, int(lab.max())))
    return lab


def _normalise(px):
    x = px.astype(np.float32) / np.float32(255.0)
    x -= np.float32(MEAN)
    x /= np.float32(STD)
    return torch.from_numpy(x)


def load_fashion_mnist(data_dir):
    p = lambda name: os.path.join(data_dir, name)  # noqa: E731
    xtr = _normalise(read_idx_images(p(TRAIN_IMAGES), 60000))
    ytr = torch.from_numpy(read_idx_labels(p(TRAIN_LABELS), 60000).astype(np.int64))
    xte = _normalise(read_idx_images(p(TEST_IMAGES), 10000))
    yte = torch.from_numpy(read_idx_labels(p(TEST_LABELS), 10000).astype(np.int64))
    return xtr, ytr, xte, yte


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------

def build_mlp(layers):
    mods = []
    for i in range(len(layers) - 1):
        mods.append(nn.Linear(layers[i], layers[i + 1]))
        if i < len(layers) - 2:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def epoch_part(n_samples, seed, epoch, rank, world):
    """DistributedSampler-like split: permutation seeded by seed+epoch,
    rank takes perm[rank::world] (disjoint, covers every sample once)."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    perm = torch.randperm(n_samples, generator=g)
    return perm[rank::world]


def train_epoch(model, opt, x, y, idx, batch):
    """One pass over idx in minibatches. Returns (loss_sum, n)."""
    model.train()
    loss_sum = 0.0
    n = idx.numel()
    for s in range(0, n, batch):
        b = idx[s:s + batch]
        xb = x.index_select(0, b)
        yb = y.index_select(0, b)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        loss_sum += loss.item() * b.numel()  # CPU tensor: no device sync
    return loss_sum, n


@torch.no_grad()
def evaluate(model, x, y):
    model.eval()
    correct = 0
    loss_sum = 0.0
    for s in range(0, x.shape[0], 1000):
        logits = model(x[s:s + 1000])
        loss_sum += F.cross_entropy(logits, y[s:s + 1000], reduction="sum").double().item()
        correct += int((logits.argmax(1) == y[s:s + 1000]).sum().item())
    return correct / x.shape[0], loss_sum / x.shape[0]


# --------------------------------------------------------------------------
# Workers
# --------------------------------------------------------------------------

def openblas_info():
    """Return (corename, config) of the OpenBLAS that torch loaded, or None."""
    try:
        lib = ctypes.CDLL("libopenblas.so.0")
        lib.openblas_get_corename.restype = ctypes.c_char_p
        lib.openblas_get_config.restype = ctypes.c_char_p
        return (lib.openblas_get_corename().decode(),
                lib.openblas_get_config().decode().strip())
    except (OSError, AttributeError):
        return None


def _log(msg):
    print(msg, flush=True)


def run_worker(rank, args, port):
    world = args.procs
    ddp = world > 1
    torch.set_num_threads(1)
    if ddp:
        torch.set_num_interop_threads(1)
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port,
                                rank=rank, world_size=world)

    xtr, ytr, xte, yte = load_fashion_mnist(args.data_dir)

    torch.manual_seed(args.seed)  # same init on every rank (DDP also broadcasts)
    net = build_mlp(args.layers)
    model = nn.parallel.DistributedDataParallel(net) if ddp else net
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    if rank == 0:
        nparams = sum(p.numel() for p in net.parameters())
        _log("model: MLP %s (%d params), SGD lr=%g momentum=%g, batch %d/proc"
             % ("-".join(map(str, args.layers)), nparams, args.lr, args.momentum,
                args.batch))
        _log("mode: %s, %d proc(s) x 1 thread, torch %s"
             % ("DDP gloo 127.0.0.1:%d" % port if ddp else "single process (no DDP)",
                world, torch.__version__))
        ob = openblas_info()
        if ob:
            _log("openblas: core %s (OPENBLAS_CORETYPE=%s) [%s]"
                 % (ob[0], os.environ.get("OPENBLAS_CORETYPE", "unset"), ob[1]))
            if ob[0].lower() in ("prescott", "core2", "katmai", "coppermine",
                                 "northwood", "banias", "atom") \
                    and "OPENBLAS_CORETYPE" not in os.environ:
                _log("openblas: WARNING: generic/old kernels were auto-selected; "
                     "try --openblas-coretype Haswell (or SkylakeX/Zen)")
        else:
            _log("openblas: not found (torch uses a different BLAS)")

    n_train = xtr.shape[0]
    train_s = 0.0
    for epoch in range(args.epochs):
        idx = epoch_part(n_train, args.seed, epoch, rank, world)
        if ddp:
            dist.barrier()
            t0 = time.perf_counter()
            with model.join():  # handles uneven parts when N does not divide 60000
                loss_sum, n = train_epoch(model, opt, xtr, ytr, idx, args.batch)
            dist.barrier()
            dt = time.perf_counter() - t0
            stats = torch.tensor([loss_sum, float(n)], dtype=torch.float64)
            dist.all_reduce(stats)  # reporting only, outside the timed region
            mean_loss, total = stats[0].item() / stats[1].item(), int(stats[1].item())
        else:
            t0 = time.perf_counter()
            loss_sum, n = train_epoch(model, opt, xtr, ytr, idx, args.batch)
            dt = time.perf_counter() - t0
            mean_loss, total = loss_sum / n, n
        train_s += dt
        if rank == 0:
            _log("epoch %d/%d: train_loss %.4f  samples %d  time %.3fs  %.0f samples/s"
                 % (epoch + 1, args.epochs, mean_loss, total, dt, total / dt))

    if rank == 0:
        acc, tloss = evaluate(net, xte, yte)
        samples_per_s = n_train * args.epochs / train_s
        _log("test: acc %.4f  loss %.4f  (10000 samples)" % (acc, tloss))
        _log("train: %d samples in %.3fs -> %.0f samples/s"
             % (n_train * args.epochs, train_s, samples_per_s))
        result = {
            "impl": "pytorch-ddp-gloo" if ddp else "pytorch-single",
            "procs": world,
            "epochs": args.epochs,
            "batch": args.batch,
            "samples_per_s": round(samples_per_s, 1),
            "train_s": round(train_s, 4),
            "test_acc": acc,
            "test_loss": round(tloss, 6),
            "torch_version": torch.__version__,
        }
        _log("RESULT " + json.dumps(result))

    if ddp:
        dist.barrier()  # keep peers alive until rank 0 finished evaluating
        dist.destroy_process_group()


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 allow_abbrev=False)
    ap.add_argument("--procs", type=int, default=2,
                    help="processes (DDP/gloo when > 1; 1 = plain single process)")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64, help="minibatch per process")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--layers", default="784,256,128,10",
                    help="comma-separated layer widths, first 784, last 10")
    ap.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    ap.add_argument("--openblas-coretype", default=None, metavar="NAME",
                    help="set OPENBLAS_CORETYPE (e.g. Haswell, SkylakeX, Zen) "
                         "before torch loads; default: OpenBLAS auto-detection")
    args = ap.parse_args(argv)
    try:
        args.layers = [int(v) for v in args.layers.split(",")]
    except ValueError:
        ap.error("--layers must be comma-separated integers")
    if len(args.layers) < 2 or args.layers[0] != 784 or args.layers[-1] != 10 \
            or min(args.layers) < 1:
        ap.error("--layers must start with 784, end with 10, all widths >= 1")
    if args.procs < 1 or args.epochs < 1 or args.batch < 1:
        ap.error("--procs, --epochs and --batch must be >= 1")
    for name in (TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS):
        if not os.path.isfile(os.path.join(args.data_dir, name)):
            ap.error("missing %s in %s (use --data-dir)" % (name, args.data_dir))
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.procs == 1:
        run_worker(0, args, 0)
        return 0
    # gloo picks its network device from the hostname unless told otherwise;
    # pin it to loopback so it matches the 127.0.0.1 rendezvous.
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    port = free_port()
    mp.spawn(run_worker, args=(args, port), nprocs=args.procs, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
