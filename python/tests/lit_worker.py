"""A LightningModule trained through psd.lightning (or alone: endpoint "-"), for the tests:
a small regression with a known answer; validation logs val_loss, val_mae (means) and
val_n (a sum) with sync_dist=True.

    lit_worker.py ENDPOINT OUT_DIR [--epochs N] [--early-stop PATIENCE] [--batch B]
"""
import argparse
import json
import os
import sys
import time

import psd.lightning  # noqa: F401  (before the model: Debian's torch 1.13 on Python 3.11)
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Data(pl.LightningDataModule):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def setup(self, stage):
        g = torch.Generator().manual_seed(7)
        x = torch.randn(1200, 8, generator=g)
        w = torch.randn(8, 1, generator=g)
        y = torch.tanh(x @ w) + 0.05 * torch.randn(1200, 1, generator=g)
        self.train, self.val = TensorDataset(x[:1000], y[:1000]), TensorDataset(x[1000:], y[1000:])

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch)


class Sleep(pl.Callback):
    def __init__(self, s):
        self.s = s

    def on_train_batch_end(self, *a):
        time.sleep(self.s)


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, i):
        x, y = batch
        p = self.net(x)
        self.log("val_loss", torch.nn.functional.mse_loss(p, y), sync_dist=True)
        self.log("val_mae", (p - y).abs().mean(), sync_dist=True)
        self.log("val_n", float(len(x)), reduce_fx="sum", sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("out")
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--early-stop", type=int, default=0)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds after each training batch")
    ap.add_argument("--key-file", help="PsdStrategy(key_file=)")
    ap.add_argument("--server-key", help="PsdStrategy(server_key=)")
    ap.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    ap.add_argument("--validate-after", action="store_true", help="trainer.validate() after the fit")
    a = ap.parse_args()
    torch.set_num_threads(1)
    cbs = [pl.callbacks.ModelCheckpoint(dirpath=os.path.join(a.out, "ckpt"), monitor="val_mae", save_last=True)]
    if a.early_stop:
        cbs.append(pl.callbacks.EarlyStopping(monitor="val_mae", patience=a.early_stop, min_delta=1.0))
    if a.sleep:
        cbs.append(Sleep(a.sleep))
    strategy = "auto" if a.endpoint == "-" else psd.lightning.PsdStrategy(a.endpoint, key_file=a.key_file,
                                                                         server_key=a.server_key)
    t = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=a.epochs, logger=pl.loggers.CSVLogger(a.out),
                   callbacks=cbs, accumulate_grad_batches=a.accumulate, enable_progress_bar=False, enable_model_summary=False)
    model, data = Net(), Data(a.batch)
    t.fit(model, data)
    s = t.strategy
    out = {"rank": t.global_rank, "epochs": t.current_epoch,
           "metrics": {k: float(v) for k, v in t.callback_metrics.items()},
           "local_figures": getattr(s, "local_figures", 0),
           "best": os.path.basename(cbs[0].best_model_path), "best_score": float(cbs[0].best_model_score or 0),
           "exit_code": getattr(getattr(s, "last_worker", None), "exit_code", None)}
    if a.validate_after:
        out["validated"] = {k: float(v) for k, v in t.validate(model, data, verbose=False)[0].items()}
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
