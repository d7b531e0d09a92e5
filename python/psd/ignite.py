"""A PyTorch Ignite trainer as a psd worker: psd.ignite.attach(trainer, model, ...).

    trainer = Engine(train_step)                  # your train_step, unchanged: it may call
    evaluator = create_supervised_evaluator(...)  #   model.optimizer.step(), model.scheduler.step()
    psd.ignite.attach(trainer, model, train_loader, val_loader, evaluator=evaluator,
                      optimizer=model.optimizer, scheduler=model.scheduler, clip_norm=model.grad_clip)
    trainer.run(train_loader, max_epochs=10)       # psd's batches, psd's epochs

Each worker process is started as psd workers are (by hand, compose, SLURM). psd holds the
weights and runs the optimizer (and scheduler) given to attach() exactly (psd.optim); the
optimizer object stays the user's and is never stepped here: its step() pushes the batch's
gradient to psd and takes psd's new weights into the model; zero_grad() does nothing (psd
zeroes the gradients before each batch) and the scheduler's step() only counts (psd steps the
schedule). The model is not wrapped: attributes set on it (optimizer, scheduler, grad_clip)
stay as they were.

What psd.ignite decides (docs/usage.md, "Ignite"):
- training batches are psd's (the user's DataLoader made again on psd's batch sampler: its
  dataset, collate_fn, workers), an Ignite epoch is one of psd's (engine.state.epoch is psd's
  from an epoch's first batch), and the epoch ends when psd's does (terminate_epoch);
- clipping: psd clips the reduced gradient (the whole batch's, as one process would) to
  clip_norm; a torch.nn.utils.clip_grad_norm_ call in the train step on the model's
  parameters is then skipped (it would clip each worker's part first: clipping twice), and
  one with another max_norm, or without clip_norm given, is refused (exit 2);
- the training loss psd reports is the scalar the train step last called backward() on,
  taken as the batch's mean;
- evaluator.run(val_loader) while training runs this worker's parts of psd's validation; its
  metrics (Loss, MeanSquaredError, MeanAbsoluteError, RootMeanSquaredError, Accuracy,
  TopKCategoricalAccuracy, MeanPairwiseDistance: means over samples) go to psd part by part,
  and evaluator.state.metrics holds psd's exact figures over every worker's parts before
  the evaluator's COMPLETED handlers (EarlyStopping, Checkpoint's score) run: every worker
  decides alike; other metrics are refused (exit 2);
- ranks are psd's: ignite.distributed's rank (the one psd gave at the first registration) and
  world size are psd's (Checkpoint and DiskSaver save on rank 0 only; its collectives are
  local, each worker holding psd's figures), and ProgressBar draws on rank 0 only (attach
  psd before the ProgressBar);
- the trainer ending first (max_epochs, terminate(): EarlyStopping) ends psd's run (exit 0);
  psd ending first (run.epochs) ends the trainer.
"""
import math

import torch

import ignite.distributed.utils as _idist_utils
from ignite.distributed.comp_models.base import _SerialModel
from ignite.engine import Events
from ignite.metrics import (Accuracy, Loss, MeanAbsoluteError, MeanPairwiseDistance, MeanSquaredError, Metric,
                            RootMeanSquaredError, TopKCategoricalAccuracy)

from ._valid import psd_name
from .torch import RunError, Worker

__all__ = ["attach", "PsdIgnite", "RunError"]

_END = object()
_active = None        # the PsdIgnite whose trainer is in an iteration (the train step runs)
_attached = None      # the last attached (its rank for ProgressBar and ignite.distributed)
_orig = {}            # the torch and Ignite functions psd.ignite stands in for, installed once


def _metric_kind(m):
    """How a metric's value over n samples becomes a sum psd adds up: "mean" (value x n),
    "rms" (value^2 x n), "acc" (a fraction of the samples: value x n); None: not one."""
    if isinstance(m, RootMeanSquaredError):
        return "rms"
    if isinstance(m, (Accuracy, TopKCategoricalAccuracy)):
        return "acc"
    if isinstance(m, (Loss, MeanAbsoluteError, MeanSquaredError, MeanPairwiseDistance)):
        return "mean"
    return None


def _key(name, kind):
    """psd's name of a metric's sums: a root mean square goes as its squares (NAME_sq: psd's
    metrics file shows their mean), the rest as psd_name gives."""
    key = psd_name(name)
    return key[:29] + "_sq" if kind == "rms" and key not in ("loss", "correct") else key


class _PsdComputation(_SerialModel):
    """ignite.distributed's view of a psd worker: psd's rank and world size, local collectives
    (every worker holds psd's weights and psd's figures)."""
    name = "psd"

    def __init__(self, att):
        super().__init__()
        self._att = att

    def get_rank(self):
        return self._att.first_rank

    def get_world_size(self):
        return self._att.world

    def get_nnodes(self):
        return self._att.world

    def get_node_rank(self):
        return self._att.first_rank


def _backward(self, *args, **kw):
    """torch.Tensor.backward: the scalar a train step calls it on is the batch's loss."""
    att = _active
    if att is not None and self.numel() == 1:
        att._loss = self.detach()
    return _orig["backward"](self, *args, **kw)


def _clip_grad_norm_(parameters, max_norm, *args, **kw):
    """torch.nn.utils.clip_grad_norm_ in an attached train step, on the model's parameters:
    psd clips the reduced gradient instead (the norm is returned, nothing clipped)."""
    att = _active
    if att is None:
        return _orig["clip"](parameters, max_norm, *args, **kw)
    params = [parameters] if torch.is_tensor(parameters) else list(parameters)
    if not params or not all(id(p) in att._param_ids for p in params):
        return _orig["clip"](params, max_norm, *args, **kw)
    return att._local_clip(params, float(max_norm), *args, **kw)


def _progress_attach(self, engine, *args, **kw):
    """ProgressBar.attach: on rank 0 only once psd.ignite is attached."""
    if _attached is not None and _attached.first_rank != 0:
        return None
    return _orig["pbar"](self, engine, *args, **kw)


def _install():
    if _orig:
        return
    _orig["backward"] = torch.Tensor.backward
    torch.Tensor.backward = _backward
    import torch.nn.utils as nnu
    import torch.nn.utils.clip_grad as cg
    _orig["clip"] = cg.clip_grad_norm_
    nnu.clip_grad_norm_ = _clip_grad_norm_
    cg.clip_grad_norm_ = _clip_grad_norm_
    try:
        from ignite.handlers import ProgressBar
    except ImportError:  # tqdm missing: no ProgressBar to guard
        return
    _orig["pbar"] = ProgressBar.attach
    ProgressBar.attach = _progress_attach


class _Loader:
    """What the evaluator iterates in place of the user's loader: unsized (its run ends with
    this worker's parts)."""

    def __init__(self, batches, inner):
        self._batches = batches
        self.inner = inner
        self.dataset = inner.dataset
        self.batch_size = getattr(inner, "batch_size", None)

    def __iter__(self):
        return self._batches(self.inner)


class _Sized(_Loader):
    """What the trainer iterates: sized with a constant bound (len(dataset): every batch holds
    a sample), so that Ignite never ends an epoch itself; psd.ignite ends it where psd's does."""

    def __len__(self):
        return max(1, len(self.dataset))


class PsdIgnite:
    """psd attached to an Ignite trainer (and evaluator): see the module's docstring and
    attach(). worker: the psd.torch.Worker; rank, world: psd's; first_rank: the rank psd gave
    this worker when it first registered, ignite.distributed's rank (a worker that registers
    again after psd is restarted keeps it: Checkpoint's files stay its own); local_figures:
    validations whose figures stayed this worker's own (psd lost meanwhile)."""

    def __init__(self, trainer, model, train_loader, val_loader, evaluator=None, optimizer=None, scheduler=None,
                 scheduler_interval="step", clip_norm=None, endpoint=None, **worker_kw):
        global _attached
        for name, dl in (("train_loader", train_loader), ("val_loader", val_loader)):
            if not isinstance(dl, torch.utils.data.DataLoader):
                raise ValueError("psd.ignite: %s is a torch.utils.data.DataLoader (psd hands out sample ids)" % name)
            if isinstance(dl.dataset, torch.utils.data.IterableDataset):
                raise ValueError("psd.ignite: psd hands out sample ids: %s's dataset is map-style, not an "
                                 "IterableDataset" % name)
        if scheduler_interval not in ("step", "epoch"):
            raise ValueError("psd.ignite: scheduler_interval is 'step' (stepped in the train step) or 'epoch'")
        self.trainer = trainer
        self.evaluator = evaluator
        self.clip_norm = float(clip_norm) if clip_norm else None
        self._interval = scheduler_interval
        self._train_dl = train_loader
        self._val_dl = val_loader
        self._param_ids = {id(p) for p in model.parameters()}
        self._loss = None
        self._stepped = False
        self._next = _END
        self._gen = None
        self._fitting = False
        self._said_clip = False
        self._val = None
        self.local_figures = 0
        self.worker = Worker(endpoint, model, len(train_loader.dataset), len(val_loader.dataset), optimizer=optimizer,
                             scheduler=scheduler, scheduler_interval=scheduler_interval, clip_norm=self.clip_norm,
                             validate_fn=self._validate_outside, **worker_kw)
        self.first_rank = self.worker.rank
        self._epochs = self.worker.epochs()
        _install()
        _attached = self
        # `from torch.nn.utils import clip_grad_norm_` in the train step's module: that name too
        g = getattr(getattr(trainer, "_process_function", None), "__globals__", {})
        for k, v in list(g.items()):
            if v is _orig["clip"]:
                g[k] = _clip_grad_norm_
        _idist_utils._set_model(_PsdComputation(self))
        _idist_utils._need_to_sync = False  # a _SerialModel: Ignite would look for a torch.distributed context
        if optimizer is not None:
            optimizer.step = self._opt_step
            optimizer.zero_grad = lambda set_to_none=None: None  # psd zeroes them (views of its memory)
        model.zero_grad = lambda set_to_none=None: None
        if scheduler is not None:
            scheduler.step = self._sched_step
        self._trainer_run = trainer.run
        trainer.run = self._run
        trainer.add_event_handler(Events.ITERATION_STARTED, self._iter_started)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, self._iter_completed)
        trainer.add_event_handler(Events.COMPLETED, self._ended)
        trainer.add_event_handler(Events.TERMINATE, self._ended)
        if evaluator is not None:
            self._eval_run = evaluator.run
            evaluator.run = self._evaluate

    # -- psd's view ---------------------------------------------------------------------
    @property
    def rank(self):
        return self.worker.rank

    @property
    def world(self):
        return self.worker.world

    # -- training -----------------------------------------------------------------------
    def _run(self, data=None, max_epochs=None, epoch_length=None, **kw):
        """trainer.run(data): psd's batches of the user's loader (data given at attach)."""
        if epoch_length is not None:
            raise ValueError("psd.ignite: no epoch_length: an epoch is psd's")
        self._fitting = True
        try:
            return self._trainer_run(_Sized(self._epoch_batches, self._psd_loader()), max_epochs=max_epochs,
                                     **kw)
        finally:
            self._fitting = False

    def _psd_loader(self):
        """The user's training DataLoader made again on psd's batch sampler."""
        dl, w = self._train_dl, self.worker
        if dl.batch_size is not None and dl.batch_size != w.batch_size:
            w.log("psd.ignite: batches of psd's train.batch_size %d (the DataLoader's %d is not used)" %
                  (w.batch_size, dl.batch_size))
        kw = {}
        if dl.num_workers > 0:
            kw = dict(persistent_workers=dl.persistent_workers, prefetch_factor=dl.prefetch_factor)
        return torch.utils.data.DataLoader(dl.dataset, batch_sampler=w.sampler(), num_workers=dl.num_workers,
                                           collate_fn=dl.collate_fn, pin_memory=dl.pin_memory,
                                           worker_init_fn=dl.worker_init_fn, **kw)

    def _epoch_batches(self, loader):
        """One Ignite epoch: psd's next epoch, its batches; the look ahead in optimizer.step()
        says when it ends."""
        try:
            epoch = next(self._epochs)
        except StopIteration:  # psd ended the run
            self.trainer.terminate()
            return
        self.trainer.state.epoch = epoch + 1
        self._gen = self.worker.batches(loader)
        self._next = next(self._gen, _END)
        while self._next is not _END:
            batch, self._next = self._next, None
            yield batch

    def _iter_started(self, engine):
        global _active
        _active = self
        self._stepped = False
        self._loss = None

    def _iter_completed(self, engine):
        global _active
        _active = None
        if not self._stepped:
            raise RunError("psd.ignite: the train step did not call optimizer.step() (psd steps every batch; "
                           "gradient accumulation: psd's train.batch_size)", 2)
        if self._next is _END:
            engine.terminate_epoch()

    def _opt_step(self, closure=None):
        """optimizer.step(): push the batch's gradient, psd's new weights into the model."""
        loss = closure() if closure is not None else None
        if _active is not self:
            raise RunError("psd.ignite: optimizer.step() outside the trainer's train step: psd steps the "
                           "optimizer", 2)
        if self._stepped:
            raise RunError("psd.ignite: optimizer.step() twice in one train step: psd steps every batch once", 2)
        if loss is not None and torch.is_tensor(loss) and loss.numel() == 1:
            self._loss = loss.detach()
        w = self.worker
        a, b = w._plan.cur
        w.step(loss_sum=float(self._loss) * (b - a) if self._loss is not None else 0.0)
        self._stepped = True
        self._next = next(self._gen, _END)  # psd's next batch, or the epoch's end
        return loss

    def _sched_step(self, *args, **kw):
        """scheduler.step(): psd steps the schedule; here only where it is called is checked."""
        inside = _active is self
        if inside != (self._interval == "step"):
            raise RunError("psd.ignite: the scheduler is stepped %s the train step: give attach(scheduler_interval="
                           "%r)" % ("in" if inside else "outside", "step" if inside else "epoch"), 2)

    def _local_clip(self, params, max_norm, *args, **kw):
        if self.clip_norm is None or not math.isclose(max_norm, self.clip_norm, rel_tol=1e-6):
            raise RunError("psd.ignite: the train step clips the gradient to %g: psd clips the reduced gradient "
                           "(as one process clips the whole batch's): give attach(clip_norm=%g)" %
                           (max_norm, max_norm), 2)
        if not self._said_clip:
            self._said_clip = True
            self.worker.log("psd.ignite: psd clips the reduced gradient to %g; the train step's clip_grad_norm_ "
                            "is skipped (clipping each worker's part first would clip twice)" % self.clip_norm)
        # torch's own norm (its norm_type and the rest as given), clipping nothing
        return _orig["clip"](params, math.inf, *args, **kw)

    def _ended(self, engine):
        """The trainer ended (max_epochs, terminate()) with psd's run still on: end psd's."""
        global _active
        _active = None
        w = self.worker
        if w._c is None:
            return
        if w.ending:  # psd ended the run: its SHUTDOWN acted on (the worker's exit code; raised if not 0)
            for _ in self._epochs:
                pass
        else:
            w.end_run("its Ignite trainer ended (epoch %d)" % engine.state.epoch)

    # -- validation ---------------------------------------------------------------------
    def _metrics(self):
        """(name, metric, kind) of the metrics attached to the evaluator."""
        out = []
        for h, args, kw in self.evaluator._event_handlers.get(Events.EPOCH_COMPLETED, []):
            m = getattr(h, "__self__", None)
            if not isinstance(m, Metric) or getattr(h, "__name__", "") != "completed":
                continue
            name = [a for a in args if isinstance(a, str)]
            name = name[-1] if name else kw.get("name")
            kind = _metric_kind(m)
            if kind is None:
                raise RunError("psd.ignite: metric %r (%s): psd adds the workers' sums up; it takes means over "
                               "samples (Loss, MeanSquaredError, MeanAbsoluteError, RootMeanSquaredError, Accuracy, "
                               "TopKCategoricalAccuracy, MeanPairwiseDistance)" % (name, type(m).__name__), 2)
            out.append((name, m, kind))
        keys = [_key(n, k) for n, _, k in out]
        if len(set(keys)) != len(keys):
            raise RunError("psd.ignite: two metrics have the same psd name (%s)" % ", ".join(keys), 2)
        return out

    def _evaluate(self, data=None, max_epochs=None, epoch_length=None, **kw):
        """evaluator.run(val_loader): while training, this worker's parts of psd's validation,
        then psd's figures in evaluator.state.metrics; else the evaluator alone."""
        if not self._fitting or self.worker._c is None:
            return self._eval_run(data, max_epochs=max_epochs, epoch_length=epoch_length, **kw)
        ev = self.evaluator
        if ev.has_event_handler(self._write_back, Events.EPOCH_COMPLETED):
            ev.remove_event_handler(self._write_back, Events.EPOCH_COMPLETED)
        ev.add_event_handler(Events.EPOCH_COMPLETED, self._write_back)  # after the metrics' own
        self._val = None
        # a new run whose length is the parts' (Ignite 0.5.5 would take the last run's epoch_length)
        ev.state.max_epochs = None
        ev.state.epoch_length = None
        if hasattr(ev.state, "max_iters"):
            ev.state.max_iters = None
        return self._eval_run(_Loader(self._val_batches, data if data is not None else self._val_dl),
                              max_epochs=1, **kw)

    def _val_batches(self, dl):
        w = self.worker
        metrics = self._metrics()
        bs = dl.batch_size or w.val_batch_size
        ds, collate = dl.dataset, dl.collate_fn
        local = {"count": 0}
        epoch = None
        for part in w.parts():
            if part.split != "test":
                raise RunError("psd.ignite: psd validates a held-out part of the training set "
                               "(data.val_fraction/val_size); with Ignite, the evaluator's loader is the "
                               "validation set: remove them from psd's config", 2)
            for _, m, _ in metrics:
                m.reset()
            for at in range(0, len(part.ids), bs):
                yield collate([ds[i] for i in part.ids[at:at + bs]])
                w.heartbeat()
            n = len(part.ids)
            loss, correct, sums = 0.0, 0, {}
            for name, m, kind in metrics:
                v = float(m.compute())
                s = v * v * n if kind == "rms" else v * n
                if not math.isfinite(s):
                    raise RunError("psd.ignite: metric %s = %r" % (name, v), 2)
                key = _key(name, kind)
                local[key] = local.get(key, 0.0) + s
                if key == "loss":
                    loss = s
                elif key == "correct":
                    correct = int(round(s))
                else:
                    sums[key] = s
            local["count"] += n
            w.answer(part, loss, correct, n, sums)
            epoch = part.epoch
        if epoch is None and not w.ending:
            # no part for this worker (or psd lost): one batch, so that the metrics can compute
            yield next(iter(dl))
        self._val = (epoch, local, metrics)
        if w.ending:
            self.trainer.terminate()

    def _write_back(self, engine):
        """evaluator.state.metrics := psd's figures of the validation (or, psd lost, this
        worker's own over its parts)."""
        if self._val is None:
            return
        epoch, local, metrics = self._val
        lv = self.worker.last_val
        if epoch is not None and lv is not None and lv["epoch"] == epoch and not lv["final"] and lv["count"]:
            count = lv["count"]
            total = dict(lv["sums"], loss=lv["loss_sum"], correct=lv["correct"])
        elif local["count"]:
            count, total = local["count"], local
            self.local_figures += 1
            self.worker.log("psd.ignite: psd's figures of this validation did not come (psd lost?): the "
                            "evaluator's metrics are this worker's own")
        else:
            self.local_figures += 1
            return
        for name, m, kind in metrics:
            t = total.get(_key(name, kind))
            if t is None:
                continue
            engine.state.metrics[name] = math.sqrt(t / count) if kind == "rms" else t / count

    def _validate_outside(self, split, ids):
        """psd's VALIDATE outside evaluator.run (this worker joined during a validation, or its
        loop did not run the evaluator): the evaluator's metrics on the part, in a throwaway
        engine (no handler of the user's runs)."""
        from ignite.engine import Engine
        if split != "test":
            raise RunError("psd.ignite: psd validates a held-out part of the training set: remove "
                           "data.val_fraction/val_size from psd's config", 2)
        if self.evaluator is None:
            raise RunError("psd.ignite: psd asked for a validation: give attach(evaluator=)", 2)
        metrics = self._metrics()
        dl = self._val_dl
        bs = dl.batch_size or self.worker.val_batch_size
        batches = [dl.collate_fn([dl.dataset[i] for i in ids[at:at + bs]]) for at in range(0, len(ids), bs)]
        tmp = Engine(self.evaluator._process_function)
        for name, m, _ in metrics:
            m.attach(tmp, name)
        state = tmp.run(batches, max_epochs=1)
        out = {"count": len(ids)}
        for name, m, kind in metrics:
            v = float(state.metrics[name])
            out[_key(name, kind)] = v * v * len(ids) if kind == "rms" else v * len(ids)
        if "correct" in out:
            out["correct"] = int(round(out["correct"]))
        return out


def attach(trainer, model, train_loader, val_loader, *, evaluator=None, optimizer=None, scheduler=None,
           scheduler_interval="step", clip_norm=None, endpoint=None, key_file=None, server_key=None, data_id="",
           **worker_kw):
    """Make this process's Ignite trainer a psd worker (registers with psd at once; returns the
    PsdIgnite). model: the nn.Module the train step trains (never wrapped); train_loader,
    val_loader: the DataLoaders trainer.run and evaluator.run are given (their datasets'
    sizes are told to psd); evaluator: the engine whose metrics are psd's validation;
    optimizer, scheduler: the train step's (offered to psd, which runs them; psd.optim says
    which); scheduler_interval: "step" when the train step steps the scheduler, "epoch" when a
    handler does once an epoch; clip_norm: the gradient's global norm psd clips the reduced
    gradient to (the train step's clip_grad_norm_ is then skipped). endpoint: psd's (None:
    PSD_ENDPOINT); key_file, server_key: CurveZMQ keys (None: PSD_KEY_FILE, PSD_SERVER_KEY);
    data_id: the data's fingerprint. Other keywords go to psd.torch.Worker (threads,
    timeout_s, retry_s, shared_memory, verbose, keep_memory)."""
    return PsdIgnite(trainer, model, train_loader, val_loader, evaluator=evaluator, optimizer=optimizer,
                     scheduler=scheduler, scheduler_interval=scheduler_interval, clip_norm=clip_norm,
                     endpoint=endpoint, key_file=key_file, server_key=server_key, data_id=data_id, **worker_kw)

