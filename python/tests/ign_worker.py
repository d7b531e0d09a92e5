"""An Ignite trainer attached to psd through psd.ignite, for the tests: a small regression
with a known answer; the model carries its optimizer, scheduler and clipping as the astronomy
framework's users write it; the evaluator's metrics are Loss, MeanAbsoluteError and
RootMeanSquaredError; Checkpoint on the evaluator's COMPLETED.

    ign_worker.py ENDPOINT OUT_DIR [--epochs N] [--sleep S] [--early-stop P] [--clip C]
                  [--attach-clip C] [--interval step|epoch] [--metric NAME]
"""
import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from ignite.engine import Engine, Events, create_supervised_evaluator
from ignite.handlers import Checkpoint, DiskSaver, EarlyStopping
from ignite.metrics import Loss, MeanAbsoluteError, Precision, RootMeanSquaredError
from torch.utils.data import DataLoader, TensorDataset

import psd.ignite


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("out")
    ap.add_argument("--epochs", type=int, default=1000, help="the trainer's max_epochs")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds in each train step")
    ap.add_argument("--early-stop", type=int, default=0, help="EarlyStopping's patience on -val_loss")
    ap.add_argument("--clip", type=float, default=0.5, help="model.grad_clip (the train step clips to it)")
    ap.add_argument("--attach-clip", type=float, default=None, help="attach(clip_norm=); default: --clip")
    ap.add_argument("--interval", default="step", help="attach(scheduler_interval=); the step steps it")
    ap.add_argument("--metric", default="", help="precision: an evaluator metric psd cannot add up")
    ap.add_argument("--no-attach", action="store_true", help="one process, no psd")
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1200, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(1200, 1, generator=g)
    train_loader = DataLoader(TensorDataset(x[:1000], y[:1000]), batch_size=20, shuffle=True)
    val_loader = DataLoader(TensorDataset(x[1000:], y[1000:]), batch_size=20)

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model.optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.scheduler = torch.optim.lr_scheduler.StepLR(model.optimizer, 100, 0.5)
    model.grad_clip = a.clip

    def train_step(engine, batch):
        model.train()
        model.optimizer.zero_grad()
        xb, yb = batch
        loss = F.mse_loss(model(xb), yb)
        loss.backward()
        if model.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), model.grad_clip)
        model.optimizer.step()
        model.scheduler.step()
        if a.sleep:
            time.sleep(a.sleep)
        return loss.item()

    trainer = Engine(train_step)
    metrics = {"loss": Loss(F.mse_loss), "mae": MeanAbsoluteError(), "rmse": RootMeanSquaredError()}
    if a.metric == "precision":
        metrics["precision"] = Precision(output_transform=lambda o: ((o[0] > 0).long(), (o[1] > 0).long()))
    evaluator = create_supervised_evaluator(model, metrics=metrics)
    saver = Checkpoint({"model": model}, DiskSaver(os.path.join(a.out, "ckpt"), require_empty=False), n_saved=1,
                       score_function=lambda e: -e.state.metrics["loss"], score_name="neg_val_loss")
    evaluator.add_event_handler(Events.COMPLETED, saver)
    if a.early_stop:
        evaluator.add_event_handler(Events.COMPLETED, EarlyStopping(a.early_stop, lambda e: -e.state.metrics["loss"],
                                                                    trainer, min_delta=1e9))
    seen = []

    @trainer.on(Events.EPOCH_COMPLETED)
    def validate(engine):
        evaluator.run(val_loader)
        seen.append(dict(evaluator.state.metrics, epoch=engine.state.epoch))

    att = None
    if not a.no_attach:
        att = psd.ignite.attach(trainer, model, train_loader, val_loader, evaluator=evaluator,
                                optimizer=model.optimizer, scheduler=model.scheduler, scheduler_interval=a.interval,
                                clip_norm=a.clip if a.attach_clip is None else a.attach_clip,
                                endpoint=a.endpoint or None)
    trainer.run(train_loader, max_epochs=a.epochs)
    res = {"epochs": trainer.state.epoch, "seen": seen,
           "ckpt": str(saver.last_checkpoint) if saver.last_checkpoint else None}
    if att is not None:
        w = att.worker
        res.update(rank=att.rank, local_figures=att.local_figures, exit_code=w.exit_code, steps=w.steps)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
