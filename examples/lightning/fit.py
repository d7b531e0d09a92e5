"""Train traffic.py's DCRNN (or weather.py's mesh forecaster, --model weather) with PyTorch
Lightning: one process, Lightning's DDP, or psd.

    python3 examples/lightning/fit.py --epochs 5 --out runs/single              # one process
    python3 examples/lightning/fit.py --epochs 5 --ddp 2 --out runs/ddp         # DDP (gloo), 2 processes
    python3 examples/lightning/fit.py --epochs 5 --psd tcp://127.0.0.1:5555 --out runs/psd   # a psd worker
    python3 examples/lightning/fit.py --model weather --psd "" --out runs/w0    # endpoint: $PSD_ENDPOINT

The module, the data and the Trainer are the same in the three; only the strategy line differs.
With psd, run one per worker (psd started on examples/lightning/psd.yaml; README.md). At the end
rank 0 prints a line for scripts (bench/lightning.sh):

    RESULT mode=single samples_per_s=... train_s=... val_mae=... best_val_mae=... epochs=...
"""
import argparse
import os
import sys
import time


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["dcrnn", "weather"], default="dcrnn",
                    help="traffic.py's DCRNN, or weather.py's mesh forecaster")
    ap.add_argument("--epochs", type=int, default=None, help="default: DCRNN 5, weather 16")
    ap.add_argument("--batch-size", type=int, default=None, help="per process (DDP rank, psd worker); default: "
                    "DCRNN 64, weather 16")
    ap.add_argument("--seed", type=int, default=0, help="initial weights and data order (the data's own: --data-seed)")
    ap.add_argument("--data-seed", type=int, default=0, help="the graph and the series")
    ap.add_argument("--hidden", type=int, default=None, help="units per DCGRU cell (default 16; the paper's: 64), "
                    "or of the mesh forecaster's nodes and edges (default 24)")
    ap.add_argument("--layers", type=int, default=None, help="DCGRU layers of the encoder and of the decoder (default "
                    "1; paper: 2), or the mesh forecaster's processor rounds (default 2)")
    ap.add_argument("--hops", type=int, default=2, help="diffusion steps K; 0: a per-node GRU, no graph")
    ap.add_argument("--lr", type=float, default=None, help="default: DCRNN 1e-2, weather 3e-3")
    ap.add_argument("--milestones", type=int, nargs="*", default=[], help="epochs where lr x 0.1 (MultiStepLR)")
    ap.add_argument("--psd", metavar="ENDPOINT", help="train as a psd worker (psd.lightning; \"\": PSD_ENDPOINT, as "
                    "SLURM and compose set it); omit: no psd")
    ap.add_argument("--ddp", type=int, default=1, metavar="N", help="N > 1: Lightning's DDP, N processes (gloo)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")),
                    help="torch threads per process (default: $OMP_NUM_THREADS, else 1)")
    ap.add_argument("--out", default="lightning-runs", help="CSV logs and checkpoints go here")
    a = ap.parse_args()
    if a.psd is not None and a.ddp > 1:
        ap.error("--psd and --ddp: one or the other")
    weather = a.model == "weather"
    a.epochs = a.epochs if a.epochs is not None else 16 if weather else 5
    a.batch_size = a.batch_size if a.batch_size is not None else 16 if weather else 64
    a.lr = a.lr if a.lr is not None else 3e-3 if weather else 1e-2
    a.hidden = a.hidden if a.hidden is not None else 24 if weather else 16
    a.layers = a.layers if a.layers is not None else 2 if weather else 1
    return a


if __name__ == "__main__":
    ARGS = parse_args()
    # Before torch loads: Debian's torch computes with OpenBLAS, whose thread pool is sized from the
    # environment when it loads (torch.set_num_threads does not reach it), and Lightning's DDP sets
    # OMP_NUM_THREADS to cores / processes where it is unset.
    os.environ["OMP_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = str(ARGS.threads)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def lightning_on_torch1():
    """Every LightningModule fails to construct with torch 1.13 on Python 3.11 (a
    torch.distributed._shard dataclass, fixed in torch 2.0); psd.lightning patches the one hook
    that imports it. Without psd, the same patch here."""
    try:
        import psd.lightning  # noqa: F401
    except ImportError:
        if sys.version_info >= (3, 11) and int(torch.__version__.split(".")[0]) < 2:
            from lightning.pytorch.core.module import LightningModule
            LightningModule._register_sharded_tensor_state_dict_hooks_if_available = lambda self: None


lightning_on_torch1()
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from traffic import DCRNN, TrafficData  # noqa: E402
from weather import MeshForecaster, WeatherData  # noqa: E402


def psd_strategy(endpoint):
    from psd.lightning import PsdStrategy
    return PsdStrategy(endpoint or None)


class TrainClock(pl.Callback):
    """Training seconds: from the first batch's start to the last's end, each epoch's validation
    and checkpoint left out (Lightning validates inside the training epoch)."""

    def __init__(self):
        self.train_s = self.val_s = 0.0

    def on_train_start(self, trainer, module):
        self.t0 = time.perf_counter()

    def on_validation_start(self, trainer, module):
        self.v0 = time.perf_counter()

    def on_validation_end(self, trainer, module):
        if not trainer.sanity_checking:
            self.val_s += time.perf_counter() - self.v0

    def on_train_end(self, trainer, module):
        self.train_s = time.perf_counter() - self.t0 - self.val_s


def main(a):
    torch.set_num_threads(a.threads)
    pl.seed_everything(a.seed, workers=True)

    if a.model == "weather":
        data = WeatherData(batch_size=a.batch_size, seed=a.data_seed)
        model = MeshForecaster(data.scale, hidden=a.hidden, rounds=a.layers, lr=a.lr, epochs=a.epochs)
        clip = 1.0
    else:
        data = TrafficData(batch_size=a.batch_size, seed=a.data_seed)
        model = DCRNN(data.supports, data.std, hidden=a.hidden, layers=a.layers, hops=a.hops, t_out=data.t_out,
                      lr=a.lr, milestones=a.milestones)
        clip = 5.0  # DCRNN's max_grad_norm
    strategy = psd_strategy(a.psd) if a.psd is not None else "ddp" if a.ddp > 1 else "auto"
    mode = "psd" if a.psd is not None else "ddp%d" % a.ddp if a.ddp > 1 else "single"
    clock = TrainClock()
    best = ModelCheckpoint(dirpath=os.path.join(a.out, "checkpoints"), monitor="val_mae", mode="min",
                           filename=a.model + "-{epoch}-{val_mae:.3f}")
    # one device a process: with psd, a process is a worker (psd's worker count is the job's tasks)
    trainer = pl.Trainer(accelerator="cpu", devices=a.ddp, strategy=strategy, max_epochs=a.epochs,
                         logger=CSVLogger(a.out, name=mode), callbacks=[best, clock], gradient_clip_val=clip,
                         deterministic=True, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=10)
    trainer.fit(model, data)

    if not trainer.is_global_zero:
        return 0
    val_mae, best_mae = float(trainer.callback_metrics["val_mae"]), float(best.best_model_score)
    epochs = trainer.current_epoch  # (through psd: psd's run.epochs, when fewer than --epochs)
    samples = len(data.train) * epochs
    if a.model == "weather":
        print("validation MAE %.5f after %d epochs (best %.5f); persistence %.5f" % (
            val_mae, epochs, best_mae, data.persistence_mae()))
        fields = "model=weather val_mae=%.5f best_val_mae=%.5f val_loss=%.5f" % (
            val_mae, best_mae, float(trainer.callback_metrics["val_loss"]))
        tail = "persistence_mae=%.5f" % data.persistence_mae()
    else:
        rmse = float(trainer.callback_metrics["val_mse"]) ** 0.5
        base = data.baselines()
        print("validation MAE %.3f mph, RMSE %.3f mph after %d epochs (best %.3f); without the graph: historical "
              "average %.3f, last value %.3f" % (val_mae, rmse, epochs, best_mae, base["historical_average"],
                                                 base["last_value"]))
        fields = "val_mae=%.4f best_val_mae=%.4f val_rmse=%.4f" % (val_mae, best_mae, rmse)
        tail = "ha_mae=%.4f last_mae=%.4f" % (base["historical_average"], base["last_value"])
    print("ARGS " + " ".join("%s=%s" % kv for kv in sorted(vars(a).items())))
    print("RESULT mode=%s samples_per_s=%.1f train_s=%.2f val_s=%.2f %s epochs=%d samples=%d threads=%d %s"
          % (mode, samples / clock.train_s, clock.train_s, clock.val_s, fields, epochs, samples,
             torch.get_num_threads(), tail))
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
