"""PyTorch training loops as psd workers.

    import psd.torch as pst
    model = Net()                                       # your nn.Module, never wrapped
    w = pst.Worker("tcp://127.0.0.1:5555", model, train_size=len(train), test_size=len(test),
                   data_id="fashion-mnist-v1")
    for epoch in w.epochs():                            # psd's epochs, until psd ends the run
        for idx in w.batches():                         # this worker's sample ids, exactly once an epoch
            x, y = train[idx]
            loss = F.cross_entropy(model(x), y, reduction="sum")
            (loss / len(idx)).backward()
            w.step(loss_sum=loss.item(), batch=len(idx))  # push the gradients, new weights into the parameters
        w.validate(lambda split, idx: {"loss": ..., "correct": ..., "count": len(idx)})

psd holds the master weights and the optimizer (its config's optimizer, schedule and clipping):
do not step a torch optimizer on the model (w.step says so if one did). The protocol is the C
worker library's (libpsworker.so.3, through ctypes); nothing here is compiled.
"""
import ctypes
import errno
import os
import signal
import socket

import torch

from . import _lib as L

__all__ = ["Worker", "RunError"]


class RunError(RuntimeError):
    """psd ended this worker's run with an error (the message says why)."""


def _view(ptr, n):
    """A float32 tensor over the n floats C pointer ptr points to (no copy)."""
    addr = ctypes.cast(ptr, ctypes.c_void_p).value
    if n == 0 or not addr:
        return torch.empty(0)
    return torch.frombuffer((ctypes.c_float * n).from_address(addr), dtype=torch.float32)


class Worker:
    """One psd worker around a torch.nn.Module. Registers at once: offers the
    module's parameters as the run's model (psd's model.kind from_worker:
    the first worker's table and values are the run's; later workers must
    offer the same names and shapes), then says its data's sizes and
    fingerprint. rank, world and is_chief are psd's; log() prints on rank 0
    only (verbose=True: on every rank)."""

    def __init__(self, endpoint, model, train_size, test_size, data_id="", threads=0, verbose=False,
                 shared_memory=True, timeout_s=300.0, validate_fn=None):
        self._lib = L.load()
        self.model = model
        self.verbose = verbose
        self._val_fn = validate_fn
        self._c = None
        self._params = list(model.named_parameters())
        if not self._params:
            raise ValueError("psd: the model has no parameters")
        n = len(self._params)
        offer = (L.Tensor * n)()
        values = (L.c_float_p * n)()
        for i, (name, p) in enumerate(self._params):
            if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous():
                raise ValueError("psd: parameter %s is %s on %s%s: psd workers train float32 CPU parameters" %
                                 (name, p.dtype, p.device, "" if p.is_contiguous() else ", not contiguous"))
            if len(name.encode()) > L.NAME_MAX or p.dim() > L.MAX_DIMS:
                raise ValueError("psd: parameter %s: a name of at most %d bytes and at most %d dimensions" %
                                 (name, L.NAME_MAX, L.MAX_DIMS))
            offer[i].name = name.encode()
            offer[i].ndim = p.dim()
            for d, s in enumerate(p.shape):
                offer[i].shape[d] = s
            values[i] = ctypes.cast(p.data_ptr(), L.c_float_p)
        self._identity = ctypes.create_string_buffer(16)
        self._lib.psw_make_identity(self._identity, id(self) ^ os.getpid())
        info = L.Info(device=b"cpu", device_index=-1, threads=threads, n_offer=n, offer=offer, offer_values=values,
                      identity=ctypes.cast(self._identity, ctypes.c_void_p), identity_len=16,
                      no_shm=0 if shared_memory else 1, identity_hint=socket.gethostname().encode())
        err = ctypes.create_string_buffer(512)
        c = self._lib.psw_client_new(endpoint.encode(), ctypes.byref(info), err, 512)
        if not c:
            raise RunError("psd: %s" % err.value.decode(errors="replace"))
        self._c = ctypes.c_void_p(c)
        a = L.Assign()
        rc = self._lib.psw_client_register(self._c, ctypes.byref(a), timeout_s, err, 512)
        if rc != 0:
            self.close()
            raise RunError("psd: cannot join the run at %s: %s" % (endpoint, err.value.decode(errors="replace")))
        if a.model != L.MODEL_TENSORS:
            self.close()
            raise RunError("psd trains one of its built-in models: a torch worker needs model.kind from_worker "
                           "(or tensors)")
        by_name = dict(self._params)
        self._table = []  # the run's tensors in table order: (name, parameter)
        for k in range(a.n_tensors):
            t = a.tensors[k]
            name = t.name.decode()
            p = by_name.get(name)
            if p is None or p.numel() != t.numel:
                self.close()
                raise RunError("psd: the run's tensor %d (%s, %d floats) is not one of this model's parameters" %
                               (k, name, t.numel))
            self._table.append((name, p))
        self.rank = a.rank
        self.world = 1
        self.batch_size = a.batch_size
        self.val_batch_size = a.val_batch_size
        self._timeout = max(a.step_timeout_s, 1.0)
        self._start_timeout = max(a.start_timeout_s, 1.0)
        self._zeros = {}
        self._ids = []
        self._pos = 0
        self._epoch = 0
        self._version = 0
        self._pending = None  # an event taken and not acted on yet (the next epoch's, SHUTDOWN, VALIDATE)
        self._versions = None
        self._leaving = False
        self.exit_code = None
        self.message = ""
        self._ev = [L.Event(), L.Event()]  # alternated: a pending event stays valid until the next call
        self._ev_i = 0
        self._sigterm_prev = None
        try:
            self._sigterm_prev = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread
            pass
        if self._lib.psw_client_ready(self._c, train_size, test_size, data_id.encode()) != 0:
            raise RunError("psd: data_id must be at most 255 printable characters")

    # -- the user's side --------------------------------------------------

    @property
    def is_chief(self):
        return self.rank == 0

    def log(self, *args, **kw):
        """print() on rank 0 only (every rank with verbose=True)."""
        if self.is_chief or self.verbose:
            print(*args, **kw, flush=True)

    def epochs(self):
        """psd's epochs (0-based numbers), until psd ends the run."""
        timeout = self._start_timeout
        while self._c is not None:
            ev = self._take(timeout)
            timeout = self._timeout
            if ev.kind == L.EV_EPOCH and not ev.append:
                self._epoch = ev.epoch
                self.world = ev.world
                self._ids = [ev.samples[i] for i in range(ev.n_samples)]
                self._pos = 0
                self._version = ev.version
                yield ev.epoch
            elif ev.kind == L.EV_VALIDATE:  # joined while an epoch was validated
                if self._val_fn is None:
                    raise RunError("psd asked this worker to validate before its first epoch: give Worker "
                                   "validate_fn=")
                self._answer(ev, self._val_fn)
            elif ev.kind == L.EV_SHUTDOWN:
                self._shutdown(ev)
                return

    def batches(self):
        """This worker's sample ids of the epoch, a batch (a list) at a time;
        call step() once for each. Ends when psd has no more for it."""
        if self._pos >= len(self._ids):
            self._barrier()
            if not self._after_barrier():
                return
        else:
            self._lib.psw_client_pull(self._c, self._version)
        while True:
            if not self._wait_weights():
                return
            b = self._ids[self._pos:self._pos + self.batch_size]
            self._stepped = False
            yield b
            if not self._stepped:
                raise RuntimeError("psd: call w.step() once for each batch")
            if self._pos >= len(self._ids):
                if not self._after_barrier():
                    return

    def step(self, loss_sum=0.0, batch=None, correct=0):
        """Push the batch's mean gradient (the parameters' .grad) and, while
        the epoch has more for this worker, put the next weights into the
        parameters. loss_sum and correct: the batch's sums, for psd's
        training figures."""
        b = self._ids[self._pos:self._pos + self.batch_size]
        n = len(b) if batch is None else int(batch)
        self._check_versions()
        if self._leaving:
            self.leave("SIGTERM")
            raise SystemExit(0)
        grads = (L.Grad * len(self._table))()
        keep = []
        for k, (name, p) in enumerate(self._table):
            g = p.grad
            if g is None:  # not used in this forward: a zero gradient
                g = self._zeros.get(k)
                if g is None:
                    g = self._zeros[k] = torch.zeros_like(p)
            elif g.dtype != torch.float32 or g.device.type != "cpu" or g.is_sparse:
                raise ValueError("psd: the gradient of %s is %s%s on %s: float32 dense CPU gradients only" %
                                 (name, g.dtype, " sparse" if g.is_sparse else "", g.device))
            elif not g.is_contiguous():
                g = g.contiguous()
            keep.append(g)
            grads[k].tensor = k
            grads[k].data = ctypes.cast(g.data_ptr(), L.c_float_p)
        self._pos += len(b)
        last = self._pos >= len(self._ids)
        push = L.Push(version=self._version, batch=n, loss_sum=float(loss_sum), correct=int(correct),
                      pull=0 if last else 1, n_grads=len(self._table), grads=grads)
        rc = self._lib.psw_client_push_v(self._c, ctypes.byref(push))
        if rc != 0:
            raise RunError("psd: push failed (%d)" % rc)
        while not self._lib.psw_client_push_done(self._c):  # the gradients are read from the tensors themselves
            pass
        del keep
        self._stepped = True
        if last:
            self._barrier()

    def validate(self, fn):
        """Answer psd's validation parts of this epoch (and, after the last
        epoch, its closing test) with fn(split, ids) -> {"loss": sum,
        "correct": n, "count": len(ids), "NAME": sum, ...}: split is "val"
        (held-out training samples) or "test"; fn is called a chunk of at
        most val_batch_size ids at a time, its sums added up. Returns once
        psd starts the next epoch or ends the run."""
        self._val_fn = fn
        while self._c is not None:
            ev = self._take(self._timeout)
            if ev.kind == L.EV_VALIDATE:
                self._answer(ev, fn)
            elif ev.kind in (L.EV_EPOCH, L.EV_SHUTDOWN) and not (ev.kind == L.EV_EPOCH and ev.append):
                self._pending = ev
                return

    def leave(self, reason="leaving"):
        """Leave the run (psd gives this worker's samples to the others)."""
        if self._c is not None:
            self._lib.psw_client_leave(self._c, reason.encode())
            self.close()

    def close(self):
        if self._c is not None:
            self._lib.psw_client_destroy(ctypes.byref(self._c))
            self._c = None
        if self._sigterm_prev is not None:
            try:
                signal.signal(signal.SIGTERM, self._sigterm_prev)
            except ValueError:
                pass
            self._sigterm_prev = None

    # -- events ------------------------------------------------------------

    def _on_sigterm(self, signum, frame):
        self._leaving = True

    def _take(self, timeout):
        if self._pending is not None:
            ev, self._pending = self._pending, None
            return ev
        self._ev_i ^= 1
        ev = self._ev[self._ev_i]
        err = ctypes.create_string_buffer(512)
        while True:
            if self._leaving:  # SIGTERM: leave the run cleanly (psd gives this worker's samples to the others)
                self.leave("SIGTERM")
                raise SystemExit(0)
            rc = self._lib.psw_client_next(self._c, ctypes.byref(ev), timeout, err, 512)
            if rc != -errno.EINTR:
                break
        if rc != 0:
            msg = err.value.decode(errors="replace")
            self.close()
            raise RunError("psd: %s (%d)" % (msg or "no answer", rc))
        return ev

    def _more(self, ev):
        """EPOCH with append: more samples for this epoch, or (keep) fewer."""
        if ev.keep:
            del self._ids[ev.keep:]
        else:
            self._ids.extend(ev.samples[i] for i in range(ev.n_samples))

    def _wait_weights(self):
        while True:
            ev = self._take(self._timeout)
            if ev.kind == L.EV_WEIGHTS:
                self._set_weights(ev)
                self._version = ev.version
                return True
            if ev.kind == L.EV_EPOCH and ev.append:
                self._more(ev)
                continue
            self._pending = ev  # SHUTDOWN (or what ends the epoch)
            return False

    def _after_barrier(self):
        """After this worker's barrier: more samples (a worker was lost), or
        the epoch's end (the event is kept for validate/epochs)."""
        while True:
            ev = self._take(self._timeout)
            if ev.kind == L.EV_EPOCH and ev.append:
                self._more(ev)
                if self._pos < len(self._ids):
                    self._lib.psw_client_pull(self._c, self._version)
                    return True
                self._barrier()
                continue
            self._pending = ev
            return False

    def _barrier(self):
        if self._lib.psw_client_barrier(self._c, self._epoch, len(self._ids)) != 0:
            raise RunError("psd: barrier failed")

    def _set_weights(self, ev):
        with torch.no_grad():
            for k, (name, p) in enumerate(self._table):
                p.data.copy_(_view(ev.tensors[k], ev.tensor_numel[k]).view(p.shape))
        self._versions = [p._version for _, p in self._table]

    def _check_versions(self):
        if self._versions is None:
            return
        for (name, p), v in zip(self._table, self._versions):
            if p._version != v:
                msg = ("psd: parameter %s was changed in place since psd's weights came (a torch optimizer's step?): "
                       "psd applies the optimizer; step only with w.step()" % name)
                self._lib.psw_client_fail(self._c, 0, msg.encode())
                self.close()
                raise RunError(msg)

    def _answer(self, ev, fn):
        self._set_weights(ev)
        split = "val" if ev.split == L.SPLIT_VAL else "test"
        ids = [ev.val_ids[i] for i in range(ev.n_val_ids)]
        sums = {}
        step = max(1, self.val_batch_size)
        with torch.no_grad():
            for at in range(0, len(ids), step):
                part = fn(split, ids[at:at + step])
                for key, v in part.items():
                    sums[key] = sums.get(key, 0) + (v.item() if torch.is_tensor(v) else v)
                self._lib.psw_client_heartbeat(self._c, ev.epoch)
        count = int(sums.pop("count", len(ids)))
        if count != len(ids):
            raise RunError("psd: the validation function counted %d samples of %d" % (count, len(ids)))
        loss = float(sums.pop("loss", 0.0))
        correct = int(sums.pop("correct", 0))
        names = sorted(sums)
        arr = (L.Sum * max(1, len(names)))()
        for i, key in enumerate(names):
            arr[i].name = key.encode()
            arr[i].value = float(sums[key])
        r = L.Val(epoch=ev.epoch, version=ev.version, begin=ev.val_begin, split=ev.split, loss_sum=loss,
                  correct=correct, count=count, n_sums=len(names), sums=arr)
        rc = self._lib.psw_client_val_result(self._c, ctypes.byref(r))
        if rc != 0:
            raise RunError("psd: a validation answer was refused (%d): named sums are 1 to 32 of [a-z0-9_], not "
                           "loss, acc, correct, count, samples or auc, at most 16, finite" % rc)

    def _shutdown(self, ev):
        self.exit_code = ev.exit_code
        self.message = ev.message.decode(errors="replace")
        self.close()
        if self.exit_code != 0:
            raise RunError("psd ended the run (%d): %s" % (self.exit_code, self.message))
