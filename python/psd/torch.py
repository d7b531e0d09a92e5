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

With a DataLoader: DataLoader(dataset, batch_sampler=w.sampler(), num_workers=...) and
`for x, y in w.batches(loader)`: the loader's processes read ahead; batches psd took back
(rebalancing, a lost worker's share) are dropped, and samples it adds are read in another pass.

psd holds the master weights and the optimizer (its config's optimizer, schedule and clipping,
or the ones given to Worker(optimizer=, scheduler=, clip_norm=) where its config has none):
do not step a torch optimizer on the model (w.step says so if one did). psd zeroes the
gradients before each batch; on psd's host they are computed straight into the memory psd
reads. A worker that loses psd (killed, restarted with --resume) registers again for up to
retry_s seconds and carries on. The protocol is the C worker library's (libpsworker.so.3,
through ctypes); nothing here is compiled.
"""
import atexit
import collections
import ctypes
import errno
import os
import signal
import sys
import time
import weakref

import torch

from . import _lib as L
from . import _valid
from ._exchange import Exchange
from ._plan import Plan
from ._session import LOST as _LOST, RunError, Session, exit_code_of as _exit_code_of
from .optim import Unsupported, offer_text

__all__ = ["Worker", "RunError", "Part"]

# How a worker's run ends (docs/usage.md): the Workers of this process, so that a script that
# fails (an exception not caught) tells psd why before it exits, and one that ends while
# still in the run leaves it. Installed with the first Worker.
_live = weakref.WeakSet()
_prev_hook = None


def _describe(exc_type, exc):
    where = ""
    tb = getattr(exc, "__traceback__", None)
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        where = " (%s:%d)" % (os.path.basename(tb.tb_frame.f_code.co_filename), tb.tb_lineno)
    text = ("%s: %s" % (exc_type.__name__, exc)) if str(exc) else exc_type.__name__
    return (text.replace("\n", " ")[:400] + where)


def _excepthook(exc_type, exc, tb):
    for w in list(_live):
        if isinstance(exc, KeyboardInterrupt):
            w.leave("interrupted (KeyboardInterrupt)")
        else:
            w._fail(_describe(exc_type, exc))
    if isinstance(exc, RunError):
        # psd's verdict or the run's end: one line, the worker's exit code (README "Exit codes")
        print(str(exc), file=sys.stderr, flush=True)
        try:
            atexit._run_exitfuncs()  # what a normal exit runs (a DataLoader's processes are ended)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exc.exit_code)
    (_prev_hook or sys.__excepthook__)(exc_type, exc, tb)


def _at_exit():
    for w in list(_live):  # the script ended while this worker was still in the run
        w.leave("its script ended before the run did")


def _install_hooks():
    global _prev_hook
    if _prev_hook is None:
        _prev_hook = sys.excepthook
        sys.excepthook = _excepthook
        atexit.register(_at_exit)


class Part(collections.namedtuple("Part", "split ids epoch version begin code final")):
    """One of psd's validation parts (w.parts()): split "test" or "val", ids the samples, epoch
    and version psd's; code psd's split number, begin what names the part; final: the run's
    closing test."""
    __slots__ = ()


class _Sampler:
    """A batch sampler for DataLoader(batch_sampler=w.sampler()): this
    worker's samples of the epoch not yet handed to the loader, a batch at a
    time. Iterate the loader through w.batches(loader)."""

    def __init__(self, w):
        self._w = w

    def __iter__(self):
        w = self._w
        if not w._in_loader:
            raise RuntimeError("psd: iterate the DataLoader of w.sampler() through w.batches(loader)")
        yield from w._plan.hand(w.batch_size)

    def __len__(self):
        w = self._w
        return w._plan.hand_count(w.batch_size)


class Worker:
    """One psd worker around a torch.nn.Module. Registers at once: offers the
    module's parameters as the run's model (psd's model.kind from_worker:
    the first worker's table and values are the run's; later workers must
    offer the same names and shapes), then says its data's sizes and
    fingerprint. rank, world and is_chief are psd's; log() prints on rank 0
    only (verbose=True: on every rank). wait_s, train_s and steps: seconds
    this worker waited for psd while training (its pushes, the next weights,
    its barriers), seconds in its batches() loops, and its steps.
    keep_memory (default True): this process keeps freed memory for the next
    message (psw_keep_freed_memory: glibc's malloc settings, process-wide),
    so large weights received over tcp do not fault page by page; False
    leaves the allocator as it was.
    optimizer, scheduler: the loop's torch.optim optimizer and LR scheduler,
    offered to psd, which runs them (the keys its own config sets win; do
    not step the optimizer: psd does; psd.optim says which psd runs, others
    are refused: RunError, exit 2); scheduler_interval: "epoch" when the loop
    steps the scheduler once an epoch, "step" once a batch; clip_norm: clip
    the gradient's global norm to this (torch.nn.utils.clip_grad_norm_)."""

    def __init__(self, endpoint, model, train_size, test_size, data_id="", threads=0, verbose=False,
                 shared_memory=True, timeout_s=300.0, validate_fn=None, retry_s=120.0, rows_of=None,
                 staging=None, key_file=None, server_key=None, keep_memory=True, optimizer=None, scheduler=None,
                 scheduler_interval="epoch", clip_norm=None):
        self._lib = L.load()
        if keep_memory:  # before the client's threads start: large replies then do not fault page by page
            self._lib.psw_keep_freed_memory()
        # endpoint None: PSD_ENDPOINT, as the SLURM and compose deployments set it for PSD_WORKER_CMD;
        # CurveZMQ keys (psd keygen's files): key_file/server_key, else PSD_KEY_FILE/PSD_SERVER_KEY
        endpoint = endpoint or os.environ.get("PSD_ENDPOINT")
        if not endpoint:
            raise ValueError("psd: no endpoint: give one (tcp://HOST:PORT) or set PSD_ENDPOINT")
        key_file = key_file or os.environ.get("PSD_KEY_FILE") or None
        server_key = server_key or os.environ.get("PSD_SERVER_KEY") or None
        self._keys = None
        if key_file or server_key:
            keys = [ctypes.create_string_buffer(41) for _ in range(3)]
            err = ctypes.create_string_buffer(512)
            if self._lib.psw_load_keys((key_file or "").encode(), (server_key or "").encode(), *keys, err, 512) != 0:
                raise ValueError("psd: %s" % err.value.decode(errors="replace"))
            self._keys = keys
        self.model = model
        self.verbose = verbose
        self._val_fn = validate_fn
        self._shared_memory = shared_memory
        self._params = list(model.named_parameters())
        if not self._params:
            raise ValueError("psd: the model has no parameters")
        try:  # the optimizer and scheduler offered to psd (psd.optim), refused here if psd would not run them
            text = offer_text(self._params, optimizer, scheduler, scheduler_interval, clip_norm)
        except Unsupported as e:
            _install_hooks()  # an uncaught RunError: its one line, exit 2
            raise RunError(str(e), 2) from None
        offer = text.encode() if text is not None else None
        # Embedding/EmbeddingBag(sparse=True): sparse-rows tensors, their gradient pushed as rows
        self._sparse = {(m_name + "." if m_name else "") + "weight" for m_name, m in model.named_modules()
                        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}
        if self._sparse:
            self._shared_memory = False  # rows go over the wire; psd's shared memory takes whole tensors
        self._rows_of = rows_of
        self._ex = Exchange(self._sparse, rank=lambda: self.rank)  # the gradients out, the weights in
        # parameters on a device (or staging=True on the CPU, as the tests do): through host buffers
        devices = {p.device for _, p in self._params}
        if len(devices) > 1:
            raise ValueError("psd: the model's parameters are on %s: one device only" %
                             ", ".join(sorted(str(d) for d in devices)))
        self.device = devices.pop()
        self._staged = self.device.type != "cpu" if staging is None else bool(staging)
        for name, p in self._params:
            if p.dtype != torch.float32 or not p.is_contiguous() or p.device.type not in ("cpu", "cuda"):
                raise ValueError("psd: parameter %s is %s on %s%s: psd workers train float32 parameters on the "
                                 "CPU or a CUDA device" %
                                 (name, p.dtype, p.device, "" if p.is_contiguous() else ", not contiguous"))
            if len(name.encode()) > L.NAME_MAX or p.dim() > L.MAX_DIMS:
                raise ValueError("psd: parameter %s: a name of at most %d bytes and at most %d dimensions" %
                                 (name, L.NAME_MAX, L.MAX_DIMS))
        if len(data_id.encode()) > 255 or not all(32 <= ord(ch) < 127 for ch in data_id):
            raise ValueError("psd: data_id must be at most 255 printable characters")
        # the run with psd: the client, registering (again), the events (psd/_session.py)
        self._s = Session(self._lib, endpoint, self._params, self._sparse,
                          (int(train_size), int(test_size), data_id.encode()), threads, self._shared_memory,
                          self._keys, offer, retry_s, leaving=lambda: self._leaving, bf16_given=self._staged)
        self.world = 1
        self.wait_s = 0.0
        self.train_s = 0.0
        self.steps = 0
        self.dropped = 0    # batches a DataLoader had read that psd took back before they were stepped
        self._plan = Plan()  # this worker's samples of the epoch and where it is (psd/_plan.py)
        self._epoch = 0
        self._version = 0
        self._pending = None  # an event taken and not acted on yet (the next epoch's, SHUTDOWN, VALIDATE)
        self._leaving = False
        self._in_loader = False
        self.exit_code = None
        self.message = ""
        _install_hooks()
        self._s.join(timeout_s)
        self._joined()
        _live.add(self)
        self._sigterm_prev = None
        try:
            self._sigterm_prev = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread
            pass

    # -- the user's side --------------------------------------------------

    @property
    def is_chief(self):
        return self.rank == 0

    @property
    def rank(self):
        return self._s.rank

    @property
    def batch_size(self):
        """psd's train.batch_size: this worker's batches (the global batch is the workers' sum)."""
        return self._s.batch_size

    @property
    def val_batch_size(self):
        return self._s.val_batch_size

    @property
    def rejoins(self):
        """Times this worker registered again after losing psd."""
        return self._s.rejoins

    @property
    def _c(self):
        return self._s.c

    @property
    def bytes_pushed(self):
        """Gradient bytes handed to the pushes (rows: their ids and values)."""
        return self._ex.bytes_pushed

    @property
    def rows_pushed(self):
        """Sparse rows pushed."""
        return self._ex.rows_pushed

    @property
    def copies(self):
        """Steps whose gradients were copied into psd's shared memory (a zero_grad dropped the views)."""
        return self._ex.copies

    @property
    def layer_pushes(self):
        """Tensors pushed on their own during backward (w.backward)."""
        return self._ex.layer_pushes

    def log(self, *args, **kw):
        """print() on rank 0 only (every rank with verbose=True)."""
        if self.is_chief or self.verbose:
            print(*args, **kw, flush=True)

    def epochs(self):
        """psd's epochs (0-based numbers), until psd ends the run. An epoch
        psd trains again (resumed from a checkpoint) comes again."""
        timeout = self._s.start_timeout
        while self._c is not None:
            ev = self._take(timeout)
            timeout = self._s.timeout
            if ev.kind == L.EV_EPOCH and not ev.append:
                self._adopt(ev)
                yield ev.epoch
            elif ev.kind == L.EV_VALIDATE:  # joined while an epoch was validated
                if self._val_fn is None:
                    raise RunError("psd asked this worker to validate before its first epoch: give Worker "
                                   "validate_fn=")
                self._answer(ev, self._val_fn)
            elif ev.kind == L.EV_SHUTDOWN:
                self._shutdown(ev)
                return

    def sampler(self):
        """A batch sampler for torch.utils.data.DataLoader(batch_sampler=...);
        iterate that loader through w.batches(loader)."""
        return _Sampler(self)

    def batches(self, loader=None):
        """This worker's samples of the epoch, a batch at a time: lists of
        sample ids, or with loader (a DataLoader on w.sampler()) its
        batches; call step() once for each. Ends when psd has no more for it."""
        t0 = time.perf_counter()
        try:
            if loader is None:
                yield from self._id_batches()
            else:
                yield from self._loader_batches(loader)
        finally:
            self._in_loader = False
            self.train_s += time.perf_counter() - t0

    def step(self, loss_sum=0.0, batch=None, correct=0):
        """Push the batch's mean gradient (the parameters' .grad) and, while
        the epoch has more for this worker, ask for the next weights.
        loss_sum and correct: the batch's sums, for psd's training figures.
        When it returns, the gradients are the caller's again."""
        if self._plan.cur is None:
            raise RuntimeError("psd: w.step() without a batch of w.batches()")
        a, b = self._plan.cur
        n = b - a if batch is None else int(batch)
        self._check_versions()
        if self._leaving:
            self.leave("SIGTERM")
            raise SystemExit(0)
        t0 = time.perf_counter()
        last = self._plan.pushed()
        want = self._want if self._rows_of is not None and self._in_loader is False else None
        push, keep = self._ex.push(self._version, n, loss_sum, correct, last, want)
        self._send(push, last)
        del keep  # (sent: _send waits until the library lets the tensors go)
        self.wait_s += time.perf_counter() - t0

    def _want(self):
        """The table rows the next batch reads (rows_of): the reply brings only those."""
        nxt = self._plan.upcoming(self.batch_size)
        return torch.unique(torch.as_tensor(self._rows_of(nxt), dtype=torch.int64).reshape(-1)).to(torch.int32)

    def _send(self, push, last):
        """Push, wait until it is sent (the gradients go from the tensors themselves: untouched
        until then; the library's I/O thread wakes the wait, without the GIL, as it lets the last
        buffer go), and end the batch; last: the epoch's last sample so far (the barrier)."""
        rc = self._lib.psw_client_push_v(self._c, ctypes.byref(push))
        if rc == 0:
            rc = self._wait_sent()
        if rc in _LOST:  # the batch is trained again by whoever gets it
            self._pending = self._s.lost("the push failed (%d)" % rc, self._ex.detach, self._back)
            last = False
        elif rc == 1:
            raise RunError("psd: a push was not sent in %.0f s" % self._s.timeout, 1)
        elif rc != 0:
            raise RunError("psd: push failed (%d)" % rc, 1)
        self.steps += 1
        self._stepped = True
        if last and self._c is not None:
            self._barrier()

    def backward(self, loss, loss_sum=0.0, batch=None, correct=0):
        """loss.backward() and step(loss_sum, batch, correct), where the
        parameters are staged (a device's): each layer's gradient goes to psd
        as soon as backward has computed it and it is in host memory, while
        backward goes on with the layers below; the last one with step()."""
        if self._ex.stg is None:
            loss.backward()
            return self.step(loss_sum=loss_sum, batch=batch, correct=correct)
        if self._plan.cur is None:
            raise RuntimeError("psd: w.backward() without a batch of w.batches()")
        a, b = self._plan.cur
        self._ex.backward(loss, self._version, b - a if batch is None else int(batch), loss_sum, correct,
                          self._send_layer)
        return self.step(loss_sum=loss_sum, batch=batch, correct=correct)

    def _wait_sent(self):
        """0 once the push is sent (the library's I/O thread wakes the wait as it lets the last
        buffer go), 1 if it is not within the step timeout, or psd's lost code. Past a quarter of
        a second, what psd sent meanwhile is looked at: its SHUTDOWN ends the wait at once (a push
        that cannot leave, its psd shard gone, would wait out the step timeout), any other event
        is kept for after the push."""
        end = time.monotonic() + self._s.timeout
        while self._lib.psw_client_push_wait(self._c, 0.25) != 0:
            if time.monotonic() > end:
                return 1
            if self._pending is not None:
                continue
            rc, ev = self._s.poll()
            if rc == 0:
                self._pending = self._checked(ev)
                if ev.kind == L.EV_SHUTDOWN:
                    return 0
            elif rc in _LOST and rc != -errno.ETIMEDOUT:
                return rc
        return 0

    def _checked(self, ev):
        if ev.kind == L.EV_SHUTDOWN and ev.exit_code != 0:
            self._shutdown(ev)  # psd refused this worker or ended the run with an error: raised at once
        return ev

    def _send_layer(self, push):
        rc = self._lib.psw_client_push_v(self._c, ctypes.byref(push))
        if rc != 0:
            raise RunError("psd: a push of one layer failed (%d)" % rc)

    def validate(self, fn):
        """Answer psd's validation parts of this epoch (and, after the last
        epoch, its closing test) with fn(split, ids) -> {"loss": sum,
        "correct": n, "count": len(ids), "NAME": sum, ...}: split is "val"
        (held-out training samples) or "test"; fn is called a chunk of at
        most val_batch_size ids at a time, its sums added up. Returns once
        psd starts the next epoch (True) or ends the run (False)."""
        self._val_fn = fn
        for part in self.parts():
            self._answer_with(part, fn)
        return not self.ending

    def parts(self):
        """psd's validation parts for this worker, for a caller that runs its
        own evaluation (psd.lightning; w.validate is this with a function):
        each a Part (split, ids, epoch, ...), psd's weights of it in the
        parameters; answer each with w.answer() before taking the next. Ends
        when psd starts the next epoch or ends the run (w.ending); then
        w.last_val holds psd's figures of the validation, added up over every
        worker's parts."""
        while self._c is not None:
            ev = self._take(self._s.timeout)
            if ev.kind == L.EV_VALIDATE:
                yield self._part(ev)
            elif ev.kind in (L.EV_EPOCH, L.EV_SHUTDOWN) and not (ev.kind == L.EV_EPOCH and ev.append):
                self._pending = ev
                return

    def answer(self, part, loss=0.0, correct=0, count=None, sums=None):
        """Part part's sums: loss and correct summed over its samples, count
        its samples (len(part.ids)), sums {NAME: sum} (1 to 32 of [a-z0-9_],
        not loss, acc, correct, count, samples or auc, at most 16, the same
        names in every answer of the run; psd reports each as val_NAME, a
        mean per sample)."""
        names = sorted(sums or {})
        arr = (L.Sum * max(1, len(names)))()
        for i, key in enumerate(names):
            arr[i].name = key.encode()
            arr[i].value = float(sums[key])
        r = L.Val(epoch=part.epoch, version=part.version, begin=part.begin, split=part.code, loss_sum=float(loss),
                  correct=int(correct), count=len(part.ids) if count is None else int(count), n_sums=len(names),
                  sums=arr)
        rc = self._lib.psw_client_val_result(self._c, ctypes.byref(r))
        if rc in _LOST:
            return  # psd is gone: the next event says what comes (this part is validated again)
        if rc != 0:
            raise RunError("psd: a validation answer was refused (%d): named sums are 1 to 32 of [a-z0-9_], not "
                           "loss, acc, correct, count, samples or auc, at most 16, finite" % rc)

    @property
    def ending(self):
        """psd ended the run (its SHUTDOWN is taken, not yet acted on, or acted on)."""
        ev = self._pending
        return self._c is None or (ev is not None and ev.kind == L.EV_SHUTDOWN)

    @property
    def last_val(self):
        """psd's figures of its last validation, added up over every worker's
        parts as psd reduced them for its metrics file: {"epoch", "split",
        "final", "count", "loss_sum", "correct", "sums": {NAME: sum}}; None
        before psd's first (or, psd resumed, until it validates again)."""
        return self._s.last_val

    def heartbeat(self):
        """Tell psd this worker is alive (long work between psd's messages: psd
        takes a worker it hears nothing from for server.worker_timeout for lost)."""
        if self._c is not None:
            self._lib.psw_client_heartbeat(self._c, self._epoch)

    def end_run(self, reason):
        """End psd's run (the loop's own stop: Lightning's EarlyStopping,
        max_epochs): psd stops as on SIGTERM (its checkpoint, exit 0; the
        other workers get SHUTDOWN 0); this worker leaves."""
        if self._c is not None:
            self._s.end_run(reason)
            self.close()

    def leave(self, reason="leaving"):
        """Leave the run (psd gives this worker's samples to the others)."""
        if self._c is not None:
            self._s.leave(reason)
            self.close()

    def close(self):
        _live.discard(self)
        self._ex.close()
        self._s.destroy()
        if getattr(self, "_sigterm_prev", None) is not None:
            try:
                signal.signal(signal.SIGTERM, self._sigterm_prev)
            except ValueError:
                pass
            self._sigterm_prev = None

    # -- batches -----------------------------------------------------------

    def _id_batches(self):
        if not self._start_batches():
            return
        while True:
            if not self._wait_weights():
                return
            b = self._plan.next_batch(self.batch_size)
            self._stepped = False
            yield b
            if not self._stepped:
                raise RuntimeError("psd: call w.step() once for each batch")
            if self._plan.done() and not self._after_barrier():
                return

    def _loader_batches(self, loader):
        if not isinstance(getattr(loader, "batch_sampler", None), _Sampler) or loader.batch_sampler._w is not self:
            raise ValueError("psd: batches(loader) takes a DataLoader made with batch_sampler=w.sampler()")
        if not self._start_batches():
            return
        self._plan.restart_hand()
        weights = False  # the weights of the batch to come are here
        while True:  # passes over the loader: another when psd added samples after the sampler ended
            self._in_loader = True
            for data in loader:
                ent = self._plan.fifo.popleft()
                if self._valid(ent) and not weights:
                    self._plan.head = ent  # voided too if psd takes its samples back meanwhile
                    ok = self._wait_weights()
                    self._plan.head = None
                    if not ok:
                        return
                    weights = True
                if not self._valid(ent):  # psd took its samples back (or gave the epoch anew)
                    self.dropped += 1
                    continue
                self._plan.cur = (ent[0], ent[1])
                self._stepped = False
                weights = False
                yield data
                if not self._stepped:
                    raise RuntimeError("psd: call w.step() once for each batch")
                if self._plan.done() and not self._after_barrier():
                    return
            self._in_loader = False
            self._plan.restart_hand()
            if self._plan.done():  # not one batch this pass
                self._barrier()
                if not self._after_barrier():
                    return

    def _valid(self, ent):
        return self._plan.valid(ent)

    def _start_batches(self):
        """Ask for the first weights of the epoch's batches; False if this
        worker has none this epoch and psd gave it no more."""
        if self._plan.done():
            self._barrier()
            return self._after_barrier()
        self._lib.psw_client_pull(self._c, self._version)
        return True

    # -- events ------------------------------------------------------------

    def _on_sigterm(self, signum, frame):
        self._leaving = True

    def _take(self, timeout):
        return self._checked(self._take_any(timeout))

    def _take_any(self, timeout):
        if self._pending is not None:
            ev, self._pending = self._pending, None
            return ev
        while True:
            if self._leaving:  # SIGTERM: leave the run cleanly (psd gives this worker's samples to the others)
                self.leave("SIGTERM")
                raise SystemExit(0)
            ev = self._s.next(timeout, self._ex.detach, self._back)
            if ev is not None:  # None: a signal came (SIGTERM?): looked at above
                return ev

    def _joined(self):
        """Registered (first or again): the exchange takes the session's layout."""
        s = self._s
        self.world = s.world
        self._ex.attach(s.table, s.offsets, s.region, s.rows_ok, self._staged, s.wire16)

    def _back(self):
        """psd came back: registered again; what was handed out of the epoch is psd's again."""
        self._joined()
        self._pending = None
        self._plan.void_handed()

    def _adopt(self, ev):
        """EPOCH (not append): this worker's samples of epoch ev.epoch."""
        self._epoch = ev.epoch
        self.world = ev.world
        self._plan.adopt(ev.samples[i] for i in range(ev.n_samples))
        self._version = ev.version

    def _more(self, ev):
        """EPOCH: more samples for this epoch, fewer (keep), or, not
        append, the same epoch's anew (psd resumed it, or a pool came):
        True if this epoch goes on."""
        if not ev.append:
            if ev.epoch != self._epoch:
                return False
            self._adopt(ev)
            if self._plan.ids:
                self._lib.psw_client_pull(self._c, self._version)
            return True
        if ev.keep:
            self._plan.keep(ev.keep)
        else:
            self._plan.extend(ev.samples[i] for i in range(ev.n_samples))
        return True

    def _wait_weights(self):
        t0 = time.perf_counter()
        try:
            while True:
                ev = self._take(self._s.timeout)
                if ev.kind == L.EV_WEIGHTS:
                    self._ex.load(ev, self._s.weights16())
                    self._version = ev.version
                    self._ex.begin()
                    return True
                if ev.kind == L.EV_EPOCH and self._more(ev):
                    if self._plan.done():  # psd gave it nothing left of the epoch
                        self._barrier()
                        return self._after_barrier() and self._wait_weights()
                    continue
                self._pending = ev  # SHUTDOWN (or what ends the epoch)
                return False
        finally:
            self.wait_s += time.perf_counter() - t0

    def _after_barrier(self):
        """After this worker's barrier: more samples (a worker was lost), or
        the epoch's end (the event is kept for validate/epochs)."""
        t0 = time.perf_counter()
        try:
            while True:
                ev = self._take(self._s.timeout)
                if ev.kind == L.EV_EPOCH and self._more(ev):
                    if not self._plan.done():
                        if ev.append:
                            self._lib.psw_client_pull(self._c, self._version)
                        return True
                    self._barrier()
                    continue
                self._pending = ev
                return False
        finally:
            self.wait_s += time.perf_counter() - t0

    def _barrier(self):
        if self._lib.psw_client_barrier(self._c, self._epoch, len(self._plan.ids)) != 0:
            raise RunError("psd: barrier failed")

    def _check_versions(self):
        name = self._ex.changed()
        if name is not None:
            msg = ("psd: parameter %s was changed in place since psd's weights came (a torch optimizer's step?): "
                   "psd applies the optimizer; step only with w.step()" % name)
            self._lib.psw_client_fail(self._c, 0, msg.encode())
            self.close()
            raise RunError(msg)

    def _part(self, ev):
        """VALIDATE ev as a Part, psd's weights of it loaded (the event is the library's until the next)."""
        self._ex.load(ev, self._s.weights16())
        return Part("val" if ev.split == L.SPLIT_VAL else "test", [ev.val_ids[i] for i in range(ev.n_val_ids)],
                    ev.epoch, ev.version, ev.val_begin, ev.split, bool(ev.final))

    def _answer(self, ev, fn):
        self._answer_with(self._part(ev), fn)

    def _answer_with(self, part, fn):
        try:
            loss, correct, count, sums = _valid.answer(part.split, part.ids, fn, self.val_batch_size,
                                                       lambda: self._lib.psw_client_heartbeat(self._c, part.epoch))
        except _valid.ValidationError as e:
            raise RunError(str(e)) from None
        self.answer(part, loss, correct, count, sums)

    def _shutdown(self, ev):
        self.exit_code = _exit_code_of(ev.exit_code)
        self.message = ev.message.decode(errors="replace")
        self.close()
        if self.exit_code != 0:
            raise RunError("psd ended this worker's run (exit %d): %s" % (ev.exit_code, self.message),
                           self.exit_code)

    def _fail(self, why):
        """Tell psd this worker fails (its own error: psd logs it as failed, not lost), and close."""
        if self._c is not None:
            self._s.fail(why)
            self.close()
