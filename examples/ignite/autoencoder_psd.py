"""A convolutional autoencoder on Fashion-MNIST cutouts, trained with PyTorch Ignite.

    python3 examples/ignite/autoencoder.py --epochs 5 --out runs/single          # one process
    PSD_ENDPOINT=tcp://127.0.0.1:5555 python3 examples/ignite/autoencoder_psd.py --out runs/w0

Written as an astronomy framework's users write their models: the model carries its
optimizer, scheduler and clipping (model.optimizer, model.scheduler, model.grad_clip) and the
train step reads them. autoencoder_psd.py is autoencoder.py with the two lines psd needs
(README.md; python/tests/test_ignite.py diffs the two). At the end a line for scripts:

    RESULT val_loss=... epochs=... train_s=...
"""
import argparse
import gzip
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from ignite.engine import Engine, Events, create_supervised_evaluator
from ignite.handlers import Checkpoint, DiskSaver
from ignite.metrics import Loss, MeanAbsoluteError

import psd.ignite

FM = "/usr/share/datasets/fashion-mnist"


def load(split, limit):
    with gzip.open(os.path.join(FM, "%s-images-idx3-ubyte.gz" % split), "rb") as f:
        images = np.frombuffer(f.read(), dtype=np.uint8, offset=16).reshape(-1, 1, 28, 28)
    x = torch.from_numpy(images[:limit].astype(np.float32)) / 255.0
    return torch.utils.data.TensorDataset(x, x)  # the input is the target


class AutoEncoder(torch.nn.Module):
    def __init__(self, code=32):
        super().__init__()
        self.enc = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, stride=2, padding=1), torch.nn.ReLU(),   # 28 -> 14
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),  # 14 -> 7
            torch.nn.Flatten(), torch.nn.Linear(32 * 7 * 7, code))
        self.dec = torch.nn.Sequential(
            torch.nn.Linear(code, 32 * 7 * 7), torch.nn.ReLU(), torch.nn.Unflatten(1, (32, 7, 7)),
            torch.nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1), torch.nn.ReLU(),  # 7 -> 14
            torch.nn.ConvTranspose2d(16, 1, 4, stride=2, padding=1), torch.nn.Sigmoid())  # 14 -> 28

    def forward(self, x):
        return self.dec(self.enc(x))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--train-limit", type=int, default=60000, help="the first N training images")
    ap.add_argument("--val-limit", type=int, default=10000, help="the first N test images")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="ignite-runs", help="checkpoints go here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    train, val = load("train", a.train_limit), load("t10k", a.val_limit)
    train_loader = torch.utils.data.DataLoader(train, batch_size=a.batch_size, shuffle=True,
                                               generator=torch.Generator().manual_seed(0))
    val_loader = torch.utils.data.DataLoader(val, batch_size=500)

    model = AutoEncoder()
    model.optimizer = torch.optim.Adam(model.parameters(), lr=a.lr)
    model.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(model.optimizer,
                                                                 T_max=a.epochs * len(train_loader))
    model.grad_clip = 1.0

    def train_step(engine, batch):
        model.train()
        model.optimizer.zero_grad()
        x, _ = batch
        loss = F.mse_loss(model(x), x)
        loss.backward()
        if model.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), model.grad_clip)
        model.optimizer.step()
        model.scheduler.step()
        return loss.item()

    trainer = Engine(train_step)
    evaluator = create_supervised_evaluator(model, metrics={"loss": Loss(F.mse_loss), "mae": MeanAbsoluteError()})
    best = Checkpoint({"model": model}, DiskSaver(a.out, require_empty=False), n_saved=1,
                      score_function=lambda e: -e.state.metrics["loss"], score_name="neg_val_loss")
    evaluator.add_event_handler(Events.COMPLETED, best)

    @trainer.on(Events.EPOCH_COMPLETED)
    def validate(engine):
        evaluator.run(val_loader)
        m = evaluator.state.metrics
        print("epoch %d val_loss %.6f val_mae %.6f" % (engine.state.epoch, m["loss"], m["mae"]), flush=True)

    psd.ignite.attach(trainer, model, train_loader, val_loader, evaluator=evaluator, optimizer=model.optimizer,
                      scheduler=model.scheduler, clip_norm=model.grad_clip)
    t0 = time.perf_counter()
    trainer.run(train_loader, max_epochs=a.epochs)
    print("RESULT val_loss=%.6f val_mae=%.6f epochs=%d train_s=%.1f" % (
        evaluator.state.metrics["loss"], evaluator.state.metrics["mae"], trainer.state.epoch,
        time.perf_counter() - t0), flush=True)


if __name__ == "__main__":
    main()
