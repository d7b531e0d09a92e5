"""A PyTorch Lightning Trainer as a psd worker: Trainer(strategy=PsdStrategy(endpoint)).

    import psd.lightning                          # before the model is built (see below)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=psd.lightning.PsdStrategy("tcp://psd:5555"))
    trainer.fit(model, datamodule)               # the LightningModule unchanged

Each worker process is started as psd workers are (by hand, compose or SLURM); there is no
launcher. psd holds the weights and runs the optimizer that configure_optimizers() returns
(and gradient_clip_val, as DDP clips after its all-reduce: on the reduced gradient): the
strategy runs Lightning's closure (forward, backward, hooks) and pushes the gradients; it never
steps a local optimizer. Training batches are psd's (exactly once an epoch over the live
workers); Lightning's validation at each epoch's end runs this worker's share of psd's exact
validation, and the figures Lightning logs there are psd's, added up over every worker.

What the strategy decides (docs/usage.md, "Lightning"):
- ranks are psd's (rank 0 logs and writes Lightning's checkpoints); the worker registers in
  setup(), once configure_optimizers() has run (its optimizer is offered with the model);
- collectives are local (reduce, all_gather, broadcast, barrier): every worker holds psd's
  weights and psd's validation figures, so ModelCheckpoint and EarlyStopping decide alike;
- values logged in validation_step (means and sums, sync_dist or not) are psd's reductions at
  the epoch's end; per-step values stay this worker's own (no blocking sync); max/min are refused;
- Lightning stopping first (EarlyStopping, max_epochs, max_steps) ends psd's run (exit 0);
- fit(ckpt_path=) is a warm start (the weights; psd's --resume carries a run);
- trainer.validate/test after fit run on this process alone, on psd's last weights.

Lightning 2.2 on Debian's torch 1.13 with Python 3.11: LightningModule() fails in a torch
module fixed in torch 2.0 (torch.distributed._shard); importing this module turns off the
Lightning hook that imports it, so import psd.lightning before building the model.
"""
import importlib
import math
import os
import sys

import torch

import lightning.pytorch as pl
from lightning.pytorch.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from ._valid import psd_name
from .torch import RunError, Worker

__all__ = ["PsdStrategy", "psd_name"]


def _patch_torch113():
    """torch < 2 on Python >= 3.11: its torch.distributed._shard dataclass fails to import (a
    mutable default, fixed in torch 2.0), and LightningModule.__init__ imports it for sharded
    state-dict hooks that a psd worker never uses."""
    if sys.version_info < (3, 11) or int(torch.__version__.split(".")[0]) >= 2:
        return
    try:
        importlib.import_module("torch.distributed._shard.sharded_tensor")
    except (ImportError, ValueError):
        pl.LightningModule._register_sharded_tensor_state_dict_hooks_if_available = lambda self: None


_patch_torch113()

class _ClosureOnly:
    """The optimizer Lightning's precision plugin steps: runs the closure (forward, zero_grad,
    backward, the hooks before a step) and nothing else: psd steps."""

    def __init__(self, opt):
        self._opt = opt

    def step(self, closure=None, **_):
        return closure() if closure is not None else None

    def __getattr__(self, name):
        return getattr(self._opt, name)


class _Loader:
    """A loader Lightning iterates in place of the user's DataLoader (inner): sized with a
    constant bound, len(dataset) (every batch holds a sample), so that Lightning never reads
    ahead: each batch is done before the next is taken. Where psd's pass ends comes from psd."""

    def __init__(self, strategy, inner, batches):
        self._st = strategy
        self._batches = batches
        self.inner = inner
        self.dataset = inner.dataset
        self.batch_size = inner.batch_size

    def __len__(self):
        return max(1, len(self.dataset))

    def __iter__(self):
        return self._batches(self.inner)


def _train_loader(strategy, inner):
    """Training: the user's DataLoader on psd's batch sampler, an epoch of psd a pass; the
    epoch's end comes through the strategy's look ahead after each step (optimizer_step)."""
    return _Loader(strategy, inner, strategy._epoch_batches)


def _val_loader(strategy, inner):
    """Validation while fitting: this worker's parts of psd's validation (their samples from
    the user's validation set, in its batch size and collate_fn); the sanity check before
    training reads the user's loader itself."""
    def batches(dl):
        return iter(dl) if strategy.lightning_module.trainer.sanity_checking else strategy._val_batches(dl)
    return _Loader(strategy, inner, batches)


_END = object()


class PsdStrategy(Strategy):
    """Trains the Trainer's LightningModule as one psd worker.

    endpoint: psd's (tcp://HOST:PORT; None: PSD_ENDPOINT). key_file, server_key: CurveZMQ keys
    (None: PSD_KEY_FILE, PSD_SERVER_KEY), as psd.torch.Worker. data_id: the data's fingerprint
    (psd refuses workers whose sizes or fingerprint differ). device: the device to train on
    (None: the CPU, or with Trainer(accelerator="gpu") the GPU of SLURM_LOCALID/LOCAL_RANK). Other keywords go to psd.torch.Worker (threads, timeout_s, retry_s,
    shared_memory, verbose, keep_memory)."""

    strategy_name = "psd"

    def __init__(self, endpoint=None, *, key_file=None, server_key=None, data_id="", device=None, **worker_kw):
        super().__init__(accelerator=None, checkpoint_io=None, precision_plugin=None)
        self.cluster_environment = LightningEnvironment()  # not SLURM's: srun --ntasks=N starts psd's workers
        self._endpoint = endpoint
        self._worker_kw = dict(worker_kw, key_file=key_file, server_key=server_key, data_id=data_id)
        self._device = torch.device(device) if device is not None else None
        self.worker = None    # psd.torch.Worker, from setup() of a fit (last_worker: after it)
        self.last_worker = None
        self._rank = 0        # psd's rank, kept after the fit
        self._epochs = None   # w.epochs()
        self._gen = None      # w.batches(loader) of the epoch
        self._next = _END     # the batch after the one being stepped (_END: the epoch ended)
        self._names = {}      # logged key -> psd's name
        self._val_ds = None
        self._val_collate = None
        self._failed = None
        self.local_figures = 0  # validations whose figures are this worker's own (psd lost meanwhile)

    # -- what Lightning asks of a strategy ------------------------------------------

    @property
    def root_device(self):
        """device=, else with a CUDA accelerator the GPU of SLURM_LOCALID or LOCAL_RANK (0 by
        default: one worker process per GPU), else the CPU."""
        if self._device is not None:
            return self._device
        if type(self.accelerator).__name__ == "CUDAAccelerator":
            idx = int(os.environ.get("SLURM_LOCALID", os.environ.get("LOCAL_RANK", "0")))
            return torch.device("cuda", idx % max(1, torch.cuda.device_count()))
        return torch.device("cpu")

    def model_to_device(self):
        self.model.to(self.root_device)

    @property
    def global_rank(self):
        return self.worker.rank if self.worker is not None else self._rank

    @property
    def local_rank(self):
        return 0

    @property
    def node_rank(self):
        return 0

    @property
    def world_size(self):
        return self.worker.world if self.worker is not None else 1

    @property
    def is_global_zero(self):
        return self.global_rank == 0

    def reduce(self, tensor, group=None, reduce_op="mean"):
        return tensor  # local: see the module's docstring

    def all_gather(self, tensor, group=None, sync_grads=False):
        return tensor

    def broadcast(self, obj, src=0):
        return obj

    def barrier(self, name=None):
        pass

    def reduce_boolean_decision(self, decision, all=True):  # noqa: A002 (Lightning's name)
        return decision

    @property
    def lightning_restore_optimizer(self):
        return False  # psd holds the optimizer's state; a checkpoint's is the local, unstepped one

    # -- set-up ---------------------------------------------------------------------

    def setup(self, trainer):
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._refuse(trainer)
        module = self.lightning_module
        opt = self.optimizers[0]
        sched, interval = None, "epoch"
        if self.lr_scheduler_configs:
            cfg = self.lr_scheduler_configs[0]
            if len(self.lr_scheduler_configs) > 1 or cfg.frequency != 1:
                raise ValueError("psd.lightning: one LR scheduler stepped every epoch or every step (frequency 1)")
            sched, interval = cfg.scheduler, cfg.interval
            # psd runs it: Lightning stepping a copy on the unstepped local optimizer would only warn
            self.lr_scheduler_configs = []
        clip = trainer.gradient_clip_val or None
        trainer.gradient_clip_val = None  # psd clips the reduced gradient
        train_dl = trainer.fit_loop._data_source.dataloader()
        val_dl = trainer.fit_loop.epoch_loop.val_loop._data_source.dataloader()
        if not isinstance(train_dl, torch.utils.data.DataLoader) or not isinstance(val_dl,
                                                                                    torch.utils.data.DataLoader):
            raise ValueError("psd.lightning: train_dataloader() and val_dataloader() each return one "
                             "torch.utils.data.DataLoader (psd validates every epoch)")
        for dl in (train_dl, val_dl):
            if isinstance(dl.dataset, torch.utils.data.IterableDataset):
                raise ValueError("psd.lightning: psd hands out sample ids: a map-style Dataset, not an IterableDataset")
        self._val_ds, self._val_collate = val_dl.dataset, val_dl.collate_fn
        kw = dict(self._worker_kw)
        self.worker = Worker(self._endpoint, module, len(train_dl.dataset), len(val_dl.dataset),
                             optimizer=opt, scheduler=sched, scheduler_interval=interval, clip_norm=clip,
                             validate_fn=self._validate_outside, **kw)
        self._rank = self.worker.rank
        self.last_worker = self.worker
        self._set_rank_zero(self._rank)
        # psd zeroes the gradients before each batch; Lightning's zero_grad (after the forward)
        # would drop the views of psd's shared memory on its host
        opt.zero_grad = lambda set_to_none=None: None
        module.optimizer_zero_grad = lambda *a, **k: None
        self._epochs = self.worker.epochs()

    def _refuse(self, trainer):
        why = []
        if trainer.accumulate_grad_batches != 1:
            why.append("accumulate_grad_batches: psd steps every batch (set psd's train.batch_size)")
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm not in (None, "norm"):
            why.append("gradient_clip_algorithm='value': psd clips the reduced gradient by its norm only")
        if str(trainer.precision) not in ("32-true", "32", "bf16-mixed"):
            why.append("precision=%s: 32-true or bf16-mixed (psd trains float32 parameters; fp16's "
                       "GradScaler skips steps, psd needs every batch)" % trainer.precision)
        if trainer.fast_dev_run or trainer.overfit_batches:
            why.append("fast_dev_run / overfit_batches: psd decides the batches")
        if trainer.limit_train_batches != 1.0 or trainer.limit_val_batches != 1.0:
            why.append("limit_train_batches / limit_val_batches: psd trains and validates on every sample")
        if trainer.val_check_interval != 1.0 or trainer.check_val_every_n_epoch != 1:
            why.append("val_check_interval / check_val_every_n_epoch: psd validates at every epoch's end")
        if trainer.reload_dataloaders_every_n_epochs:
            why.append("reload_dataloaders_every_n_epochs")
        if len(self.optimizers) != 1 or not self.lightning_module.automatic_optimization:
            why.append("one optimizer, automatic optimization")
        if why:
            raise ValueError("psd.lightning: not with psd: " + "; ".join(why))

    @staticmethod
    def _set_rank_zero(rank):
        import lightning.fabric.utilities.rank_zero as fz
        from lightning_utilities.core import rank_zero as uz
        for f in {id(fz.rank_zero_only): fz.rank_zero_only, id(uz.rank_zero_only): uz.rank_zero_only}.values():
            f.rank = rank

    def process_dataloader(self, dataloader):
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.worker is None or trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return dataloader
        if trainer.state.stage == RunningStage.TRAINING:
            return _train_loader(self, self._on_psd_sampler(dataloader))
        return _val_loader(self, dataloader)

    def _on_psd_sampler(self, dl):
        """The user's DataLoader (its class, workers, collate_fn) made again on psd's batch sampler."""
        from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls
        from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs
        w = self.worker
        if dl.batch_size is not None and dl.batch_size != w.batch_size:
            w.log("psd.lightning: batches of psd's train.batch_size %d (the DataLoader's %d is not used)" %
                  (w.batch_size, dl.batch_size))
        try:
            args, kw = _get_dataloader_init_args_and_kwargs(dl, dl.sampler)
            kw.update(sampler=None, shuffle=False, batch_sampler=w.sampler(), batch_size=1, drop_last=False)
            return _reinstantiate_wrapped_cls(dl, *args, **kw)
        except Exception as e:  # a DataLoader subclass Lightning cannot make again: a plain one
            w.log("psd.lightning: the training DataLoader made again as a plain DataLoader (%s: %s)" %
                  (type(e).__name__, e))
            return torch.utils.data.DataLoader(dl.dataset, batch_sampler=w.sampler(), num_workers=dl.num_workers,
                                               collate_fn=dl.collate_fn, pin_memory=dl.pin_memory,
                                               worker_init_fn=dl.worker_init_fn)

    def on_train_start(self):
        super().on_train_start()
        if self.worker is not None:
            # a sized loader validates every val_check_batch batches; psd's epoch ends when psd says
            self.lightning_module.trainer.val_check_batch = float("inf")

    # -- training -------------------------------------------------------------------

    def _epoch_batches(self, loader):
        """One Lightning epoch: psd's next epoch, its batches; the look ahead after each step says
        when it ends."""
        trainer = self.lightning_module.trainer
        try:
            next(self._epochs)
        except StopIteration:  # psd ended the run
            trainer.should_stop = True
            return
        self._gen = self.worker.batches(loader)
        self._next = next(self._gen, _END)
        while self._next is not _END:
            batch, self._next = self._next, None
            yield batch
            if self._next is None:
                raise RuntimeError("psd.lightning: a training batch was not stepped (training_step returned "
                                   "nothing and no optimizer step ran?)")

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        if self.worker is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model if model is not None else self.lightning_module
        loss = self.precision_plugin.optimizer_step(_ClosureOnly(optimizer), model=model, closure=closure, **kwargs)
        w = self.worker
        a, b = w._plan.cur
        w.step(loss_sum=float(loss.detach()) * (b - a) if torch.is_tensor(loss) else 0.0)
        self._next = next(self._gen, _END)  # psd's next batch, or the epoch's end
        self.lightning_module.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = self._next is _END
        return loss

    # -- validation -----------------------------------------------------------------

    def _val_batches(self, inner):
        """This worker's parts of psd's validation, in batches; each part's sums (the values
        logged in validation_step since the part began) go to psd when its last batch is done.
        Then Lightning's figures become psd's, added up over every worker."""
        w = self.worker
        trainer = self.lightning_module.trainer
        bs = inner.batch_size or w.val_batch_size
        answered = 0
        for part in w.parts():
            if part.split != "test":
                raise RunError("psd.lightning: psd validates a held-out part of the training set "
                               "(data.val_fraction/val_size); with Lightning, val_dataloader() is the validation "
                               "set: remove them from psd's config", 2)
            before = self._snapshot(trainer)
            for at in range(0, len(part.ids), bs):
                yield inner.collate_fn([inner.dataset[i] for i in part.ids[at:at + bs]])
                w.heartbeat()
            loss, correct, sums = self._part_sums(trainer, before, len(part.ids))
            w.answer(part, loss, correct, len(part.ids), sums)
            answered += 1
        if w.ending:
            trainer.should_stop = True
        lv = w.last_val
        if answered and lv is not None and lv["epoch"] == part.epoch and not lv["final"]:
            self._write_back(trainer, lv)
        elif answered or not w.ending:
            # psd was lost during the validation (it gives the epoch again, or goes on): this
            # worker's own figures, over what it has seen, so that Lightning's callbacks find them
            self.local_figures += 1
            if not answered:
                yield from inner
            w.log("psd.lightning: psd's figures of this validation did not come (psd lost?): Lightning logs "
                  "this worker's own")

    def _metrics(self, trainer):
        """(key, result) of the values validation_step logged for the epoch."""
        for key, rm in trainer._results.items():
            if getattr(rm, "is_tensor", False) and rm.meta.fx == "validation_step" and rm.meta.on_epoch:
                yield rm.meta.name, rm

    def _psd_of(self, name, rm):
        n = self._names.get(name)
        if n is None:
            if not (rm.meta.is_mean_reduction or rm.meta.is_sum_reduction):
                raise RunError("psd.lightning: self.log(%r, reduce_fx=max/min) in validation_step: psd adds "
                               "the workers' values up (mean or sum only)" % name, 2)
            n = psd_name(name)
            if n in self._names.values():
                raise RunError("psd.lightning: logged values %r and %r are both psd's %r" %
                               (name, [k for k, v in self._names.items() if v == n][0], n), 2)
            if len(self._names) >= 17:
                raise RunError("psd.lightning: at most 16 values logged in validation_step besides the loss", 2)
            self._names[name] = n
        return n

    def _snapshot(self, trainer):
        return {name: (float(rm.value), int(rm.cumulated_batch_size) if rm.meta.is_mean_reduction else 0)
                for name, rm in self._metrics(trainer)}

    def _part_sums(self, trainer, before, count):
        """The part's sums: for a mean, its values times their batch sizes (scaled to the part's
        samples where Lightning counted batches otherwise); for a sum, the sum."""
        loss, correct, sums = 0.0, 0, {}
        for name, rm in self._metrics(trainer):
            v0, n0 = before.get(name, (0.0, 0))
            v = float(rm.value) - v0
            if rm.meta.is_mean_reduction:
                n = int(rm.cumulated_batch_size) - n0
                v = v * count / n if n and n != count else v
            key = self._psd_of(name, rm)
            if not math.isfinite(v):
                raise RunError("psd.lightning: validation_step logged %s = %r" % (name, v), 2)
            if key == "loss":
                loss = v
            elif key == "correct":
                correct = int(round(v))
            else:
                sums[key] = v
        return loss, correct, sums

    def _write_back(self, trainer, lv):
        """Lightning's epoch figures := psd's (each result's value, so its compute() gives psd's
        mean, or for a sum, psd's total)."""
        count = lv["count"]
        for name, rm in self._metrics(trainer):
            key = self._names.get(name)
            if key is None:
                continue
            total = lv["loss_sum"] if key == "loss" else lv["correct"] if key == "correct" else lv["sums"].get(key)
            if total is None or not count:
                continue
            if rm.meta.is_mean_reduction:
                rm.value = torch.tensor(total / count, dtype=rm.value.dtype, device=rm.value.device)
                rm.cumulated_batch_size = torch.ones_like(rm.cumulated_batch_size)
            else:
                rm.value = torch.tensor(total, dtype=rm.value.dtype, device=rm.value.device)

    def _validate_outside(self, split, ids):
        """psd's VALIDATE outside Lightning's validation loop (this worker joined during one, or had
        no batch in an epoch): validation_step on the part, its logged values as psd's sums."""
        if split != "test":
            raise RunError("psd.lightning: psd validates a held-out part of the training set: remove "
                           "data.val_fraction/val_size from psd's config", 2)
        module = self.lightning_module
        logged = {}

        def log(name, value, *a, batch_size=None, reduce_fx="mean", **kw):
            logged[name] = (float(value), reduce_fx)

        def log_dict(d, *a, **kw):
            for k, v in d.items():
                log(k, v, **kw)

        batch = self.batch_to_device(self._val_collate([self._val_ds[i] for i in ids]))
        was = module.training
        module.eval()
        module.log, module.log_dict = log, log_dict
        try:
            module.validation_step(batch, 0)
        finally:
            del module.log, module.log_dict
            module.train(was)
        out = {"count": len(ids)}
        for name, (v, fx) in logged.items():
            key = psd_name(name)
            self._names.setdefault(name, key)
            out[key] = v if fx in ("sum", torch.sum) else v * len(ids)
        return out

    # -- the run's end ----------------------------------------------------------------

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        if self.worker is not None:
            self.worker.heartbeat()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def on_exception(self, exception):
        self._failed = exception

    def teardown(self):
        w, self.worker = self.worker, None
        if w is not None and w._c is not None:
            if isinstance(self._failed, RunError):
                pass
            elif self._failed is not None:
                w._fail("%s: %s" % (type(self._failed).__name__, self._failed))
            elif w.ending:
                next(w.epochs(), None)  # psd's SHUTDOWN: its exit code taken, the worker closed
            else:
                w.end_run("Lightning ended the fit (max_epochs, max_steps, EarlyStopping or should_stop)")
        super().teardown()
