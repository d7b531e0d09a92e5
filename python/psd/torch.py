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
import ctypes
import errno
import os
import signal
import socket
import sys
import time
import weakref

import torch

from . import _lib as L
from . import _valid
from ._plan import Plan
from ._staging import Staging
from .optim import Unsupported, offer_text

__all__ = ["Worker", "RunError"]

_LOST = (-errno.ETIMEDOUT, -errno.ECONNRESET, -errno.ENOLINK)


class RunError(RuntimeError):
    """This worker's run ended with an error: psd ended it (refused this
    worker, or ended the run with a non-zero code), psd was lost for good,
    or the worker cannot go on. exit_code is the worker's exit code for it
    (psd's code where psd ended the run: README "Exit codes"). Not caught,
    the script prints its one-line message and exits with exit_code, no
    traceback."""

    def __init__(self, message, exit_code=1):
        super().__init__(message)
        self.exit_code = exit_code


def _exit_code_of(psd_code):
    """A worker's exit code for the code psd ended the run with (as pworker's)."""
    return psd_code if 0 <= psd_code <= 125 else 1


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


class _End:
    """SHUTDOWN that psd gave while this worker registered again."""
    kind = L.EV_SHUTDOWN
    append = 0

    def __init__(self, code, message):
        self.exit_code = code
        self.message = message.encode()


def _view(ptr, n):
    """A float32 tensor over the n floats C pointer ptr points to (no copy)."""
    addr = ctypes.cast(ptr, ctypes.c_void_p).value
    if n == 0 or not addr:
        return torch.empty(0)
    return torch.frombuffer((ctypes.c_float * n).from_address(addr), dtype=torch.float32)


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
        self._c = None
        self._endpoint = endpoint
        self._data = (int(train_size), int(test_size), data_id.encode())
        self._threads = threads
        self._shared_memory = shared_memory
        self._retry_s = retry_s
        self._params = list(model.named_parameters())
        if not self._params:
            raise ValueError("psd: the model has no parameters")
        try:  # the optimizer and scheduler offered to psd (psd.optim), refused here if psd would not run them
            text = offer_text(self._params, optimizer, scheduler, scheduler_interval, clip_norm)
        except Unsupported as e:
            _install_hooks()  # an uncaught RunError: its one line, exit 2
            raise RunError(str(e), 2) from None
        self._offer = text.encode() if text is not None else None
        # Embedding/EmbeddingBag(sparse=True): sparse-rows tensors, their gradient pushed as rows
        self._sparse = {(m_name + "." if m_name else "") + "weight" for m_name, m in model.named_modules()
                        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}
        if self._sparse:
            self._shared_memory = False  # rows go over the wire; psd's shared memory takes whole tensors
        self._rows_of = rows_of
        self.bytes_pushed = 0   # gradient bytes handed to the pushes (rows: their ids and values)
        self.rows_pushed = 0    # sparse rows pushed
        self._densified = False
        # parameters on a device (or staging=True on the CPU, as the tests do): through host buffers
        devices = {p.device for _, p in self._params}
        if len(devices) > 1:
            raise ValueError("psd: the model's parameters are on %s: one device only" %
                             ", ".join(sorted(str(d) for d in devices)))
        self.device = devices.pop()
        self._staged = self.device.type != "cpu" if staging is None else bool(staging)
        self._stg = None
        self._early_sent = set()  # tensors of this batch pushed during backward (w.backward)
        self.layer_pushes = 0     # tensors pushed on their own during backward (w.backward)
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
        self._identity = ctypes.create_string_buffer(16)
        self._lib.psw_make_identity(self._identity, id(self) ^ os.getpid())
        self._run_id = 0
        self._table = None  # the run's tensors in table order: (name, parameter)
        self.rank = 0
        self.world = 1
        self.wait_s = 0.0
        self.train_s = 0.0
        self.steps = 0
        self.copies = 0     # steps whose gradients were copied into shared memory (a zero_grad dropped the views)
        self.rejoins = 0    # times this worker registered again after losing psd
        self.dropped = 0    # batches a DataLoader had read that psd took back before they were stepped
        self._plan = Plan()  # this worker's samples of the epoch and where it is (psd/_plan.py)
        self._epoch = 0
        self._version = 0
        self._pending = None  # an event taken and not acted on yet (the next epoch's, SHUTDOWN, VALIDATE)
        self._versions = None
        self._leaving = False
        self._in_loader = False
        self._zeros = {}
        self._views = None
        self._flat = None       # psd's push region as one tensor (on psd's host)
        self._fast_push = None  # the push descriptor over the views of that region (_push_fast)
        self._fast_bytes = 0
        self._rviews = {}       # tensors over psd's reply buffers, by (tensor, address, numel)
        self._warned_copy = False
        self.exit_code = None
        self.message = ""
        self._ev = [L.Event(), L.Event()]  # alternated: a pending event stays valid until the next call
        self._ev_i = 0
        _install_hooks()
        rc, msg = self._session(timeout_s)
        if rc != 0:
            raise RunError("psd: cannot join the run at %s: %s" % (endpoint, msg), self._join_code(rc))
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

    def log(self, *args, **kw):
        """print() on rank 0 only (every rank with verbose=True)."""
        if self.is_chief or self.verbose:
            print(*args, **kw, flush=True)

    def epochs(self):
        """psd's epochs (0-based numbers), until psd ends the run. An epoch
        psd trains again (resumed from a checkpoint) comes again."""
        timeout = self._start_timeout
        while self._c is not None:
            ev = self._take(timeout)
            timeout = self._timeout
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
        if self._fast_push is not None and self._stg is None and all(
                p.grad is v for (_, p), v in zip(self._table, self._views)):
            self._push_fast(n, loss_sum, correct)
            self.wait_s += time.perf_counter() - t0
            return
        grads = (L.Grad * len(self._table))()
        keep = []
        copied = False
        n_rows = 0
        n_grads = 0
        if self._stg is not None:
            self._stg.finish()
        for k, (name, p) in enumerate(self._table):
            if self._stg is not None:  # from the host buffer (the tensors pushed during backward aside)
                if k in self._early_sent:
                    continue
                g = self._stg.gviews[k]
                grads[n_grads].tensor = k
                grads[n_grads].data = ctypes.cast(g.data_ptr(), L.c_float_p)
                n_grads += 1
                self.bytes_pushed += 4 * g.numel()
                continue
            n_grads += 1
            g = p.grad
            if g is not None and g.is_sparse and g.dtype == torch.float32 and g.device.type == "cpu":
                g = g.coalesce()
                if g._nnz() > 0 and name in self._sparse and self._rows_ok:  # as rows: ids, then their values
                    ids = g.indices()[0].to(torch.int32).contiguous()
                    vals = g.values().contiguous()
                    keep += [ids, vals]
                    k_ = n_grads - 1
                    grads[k_].tensor = k
                    grads[k_].row_ids = ctypes.cast(ids.data_ptr(), L.c_u32_p)
                    grads[k_].n_rows = ids.numel()
                    grads[k_].row_vals = ctypes.cast(vals.data_ptr(), L.c_float_p)
                    n_rows += ids.numel()
                    self.bytes_pushed += 4 * ids.numel() + 4 * vals.numel()
                    continue
                if g._nnz() > 0 and not self._densified:
                    self._densified = True
                    print("psd: worker %d: the sparse gradient of %s goes whole: %s" % (
                        self.rank, name, "its parameter is not an Embedding(sparse=True)" if name not in self._sparse
                        else "this run cannot take rows (psd shards whose pieces are not whole rows, or "
                        "bfloat16 gradients)"), file=sys.stderr, flush=True)
                g = g.to_dense()
            if g is None:  # not used in this forward: a zero gradient
                g = self._zeros.get(k)
                if g is None:
                    g = self._zeros[k] = torch.zeros_like(p)
            elif g.dtype != torch.float32 or g.device.type != "cpu" or g.is_sparse:
                raise ValueError("psd: the gradient of %s is %s%s on %s: float32 dense CPU gradients only" %
                                 (name, g.dtype, " sparse" if g.is_sparse else "", g.device))
            elif not g.is_contiguous():
                g = g.contiguous()
            if self._views is not None and p.grad is not None and g.data_ptr() != self._views[k].data_ptr():
                copied = True
            keep.append(g)
            grads[n_grads - 1].tensor = k
            grads[n_grads - 1].data = ctypes.cast(g.data_ptr(), L.c_float_p)
            self.bytes_pushed += 4 * g.numel()
        if copied:
            self.copies += 1
            if not self._warned_copy:
                self._warned_copy = True
                print("psd: worker %d: the gradients are not in psd's shared memory (model.zero_grad() with "
                      "set_to_none=True dropped them?): each step copies them there; psd zeroes the gradients "
                      "before each batch, so the zero_grad() call can go" % self.rank, file=sys.stderr, flush=True)
        last = self._plan.pushed()
        self.rows_pushed += n_rows
        push = L.Push(version=self._version, batch=n, loss_sum=float(loss_sum), correct=int(correct),
                      pull=0 if last else 1, n_grads=n_grads, grads=grads)
        if n_rows and not last and self._rows_of is not None and self._in_loader is False:
            # the reply brings only the table rows the next batch reads (the others stay as they were)
            nxt = self._plan.upcoming(self.batch_size)
            want = torch.unique(torch.as_tensor(self._rows_of(nxt), dtype=torch.int64).reshape(-1)).to(torch.int32)
            if want.numel():
                keep.append(want)
                push.want = ctypes.cast(want.data_ptr(), L.c_u32_p)
                push.n_want = want.numel()
        self._send(push, last)
        del keep  # (sent: _send waits until the library lets the tensors go)
        self.wait_s += time.perf_counter() - t0

    def _send(self, push, last):
        """Push, wait until it is sent (the gradients go from the tensors themselves: untouched
        until then; the library's I/O thread wakes the wait, without the GIL, as it lets the last
        buffer go), and end the batch; last: the epoch's last sample so far (the barrier)."""
        rc = self._lib.psw_client_push_v(self._c, ctypes.byref(push))
        if rc in _LOST:  # the batch is trained again by whoever gets it
            self._pending = self._lost("the push failed (%d)" % rc)
            last = False
        elif rc != 0:
            raise RunError("psd: push failed (%d)" % rc, 1)
        elif self._lib.psw_client_push_wait(self._c, self._timeout) != 0:
            raise RunError("psd: a push was not sent in %.0f s" % self._timeout, 1)
        self.steps += 1
        self._stepped = True
        if last and self._c is not None:
            self._barrier()

    def _push_fast(self, n, loss_sum, correct):
        """step() where every gradient is psd's shared-memory view (the usual case on psd's host):
        the push descriptor built once (_grads_ready) is sent as it is, with this batch's figures."""
        push = self._fast_push
        last = self._plan.pushed()
        push.version = self._version
        push.batch = n
        push.loss_sum = float(loss_sum)
        push.correct = int(correct)
        push.pull = 0 if last else 1
        self.bytes_pushed += self._fast_bytes
        self._send(push, last)

    def backward(self, loss, loss_sum=0.0, batch=None, correct=0):
        """loss.backward() and step(loss_sum, batch, correct), where the
        parameters are staged (a device's): each layer's gradient goes to psd
        as soon as backward has computed it and it is in host memory, while
        backward goes on with the layers below; the last one with step()."""
        if self._stg is None:
            loss.backward()
            return self.step(loss_sum=loss_sum, batch=batch, correct=correct)
        if self._plan.cur is None:
            raise RuntimeError("psd: w.backward() without a batch of w.batches()")
        a, b = self._plan.cur
        push = L.Push(version=self._version, batch=b - a if batch is None else int(batch), loss_sum=float(loss_sum),
                      correct=int(correct), pull=0, n_grads=1)
        pending = []

        def ready(k):
            pending.append(k)
            while len(pending) > 1 and self._stg.ready(pending[0]):  # the newest stays for step()
                j = pending.pop(0)
                self._stg.wait(j)
                g = L.Grad(tensor=j, data=ctypes.cast(self._stg.gviews[j].data_ptr(), L.c_float_p))
                push.grads = ctypes.pointer(g)
                rc = self._lib.psw_client_push_v(self._c, ctypes.byref(push))
                if rc != 0:
                    raise RunError("psd: a push of one layer failed (%d)" % rc)
                self._early_sent.add(j)
                self.layer_pushes += 1
                self.bytes_pushed += 4 * self._stg.gviews[j].numel()

        self._stg.on_ready = ready
        try:
            loss.backward()
        finally:
            self._stg.on_ready = None
        return self.step(loss_sum=loss_sum, batch=batch, correct=correct)

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
        _live.discard(self)
        self._drop_views()
        if self._stg is not None:
            self._stg.close()
            self._stg = None
        if self._c is not None:
            self._lib.psw_client_destroy(ctypes.byref(self._c))
            self._c = None
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
        ev = self._take_any(timeout)
        if ev.kind == L.EV_SHUTDOWN and ev.exit_code != 0:
            self._shutdown(ev)  # psd refused this worker or ended the run with an error: raised at once
        return ev

    def _take_any(self, timeout):
        if self._pending is not None:
            ev, self._pending = self._pending, None
            return ev
        err = ctypes.create_string_buffer(512)
        while True:
            if self._leaving:  # SIGTERM: leave the run cleanly (psd gives this worker's samples to the others)
                self.leave("SIGTERM")
                raise SystemExit(0)
            if self._c is None:
                raise RunError("psd: this worker has left the run")
            self._ev_i ^= 1
            ev = self._ev[self._ev_i]
            rc = self._lib.psw_client_next(self._c, ctypes.byref(ev), timeout, err, 512)
            if rc == -errno.EINTR:
                continue
            if rc in _LOST:
                end = self._lost(err.value.decode(errors="replace"))
                if end is not None:
                    return end
                timeout = self._start_timeout
                continue
            if rc != 0:
                msg = err.value.decode(errors="replace")
                self.close()
                raise RunError("psd: %s (%d)" % (msg or "no answer", rc), 1)
            return ev

    def _lost(self, why):
        """psd was lost (killed, restarted, silent): register again until
        retry_s has passed. Returns None once back in the run (its events
        follow: the epoch it trains now), or SHUTDOWN if psd ended it."""
        print("psd: worker %d lost psd (%s): registering again for up to %.0f s" % (self.rank, why, self._retry_s),
              file=sys.stderr, flush=True)
        self._drop_views()
        self._lib.psw_client_destroy(ctypes.byref(self._c))
        self._c = None
        start, pause = time.monotonic(), 0.25
        while True:
            if self._leaving:
                raise SystemExit(0)
            time.sleep(pause)
            pause = min(pause * 2, 5.0)
            rc, msg = self._session(5.0)
            if rc == 0:
                self.rejoins += 1
                self._versions = None
                self._pending = None
                self._plan.void_handed()
                print("psd: worker %d registered again (rank %d)" % (self.rank, self.rank), file=sys.stderr,
                      flush=True)
                return None
            if rc == -errno.ESHUTDOWN:
                return _End(self._ended_code, msg)
            if rc not in _LOST:
                raise RunError("psd: cannot join the run again: %s" % msg, self._join_code(rc))
            if time.monotonic() - start > self._retry_s:
                raise RunError("psd at %s did not come back within %.0f s" % (self._endpoint, self._retry_s), 4)

    def _session(self, timeout):
        """A client, registered, its table checked, its data said. Returns
        (0, "") or (-errno, why)."""
        n = len(self._params)  # offered again when registering again: psd checks it against the run's
        offer = (L.Tensor * n)()
        values = (L.c_float_p * n)()
        hosts = []
        for i, (name, p) in enumerate(self._params):
            offer[i].name = name.encode()
            offer[i].sparse_rows = 1 if name in self._sparse else 0
            offer[i].ndim = p.dim()
            for d, s in enumerate(p.shape):
                offer[i].shape[d] = s
            host = p.detach() if p.device.type == "cpu" else p.detach().to("cpu")
            hosts.append(host)  # read during the registration only
            values[i] = ctypes.cast(host.data_ptr(), L.c_float_p)
        info = L.Info(device=b"cpu", device_index=-1, threads=self._threads, n_offer=n, offer=offer,
                      offer_values=values, identity=ctypes.cast(self._identity, ctypes.c_void_p), identity_len=16,
                      no_shm=0 if self._shared_memory else 1, identity_hint=socket.gethostname().encode(),
                      run_id=self._run_id, prev_rank=self.rank)
        if self._keys:
            info.curve_public, info.curve_secret, info.curve_server = (k.value for k in self._keys)
        err = ctypes.create_string_buffer(512)
        c = self._lib.psw_client_new(self._endpoint.encode(), ctypes.byref(info), err, 512)
        if not c:
            return -errno.EINVAL, err.value.decode(errors="replace")
        self._c = ctypes.c_void_p(c)
        if self._offer and self._lib.psw_client_offer_config(self._c, self._offer, err, 512) != 0:  # each register
            self._lib.psw_client_destroy(ctypes.byref(self._c))
            self._c = None
            return -errno.EINVAL, err.value.decode(errors="replace")
        a = L.Assign()
        rc = self._lib.psw_client_register(self._c, ctypes.byref(a), timeout, err, 512)
        if rc != 0:
            self._ended_code = self._lib.psw_client_shutdown_code(self._c)
            self._lib.psw_client_destroy(ctypes.byref(self._c))
            self._c = None
            return rc, err.value.decode(errors="replace")
        why = self._check_table(a)
        if why:
            self._lib.psw_client_fail(self._c, 0, why.encode())
            self.close()
            raise RunError(why, 2)
        self.rank = a.rank
        self.world = a.world or 1  # psd's workers until an EPOCH says (0: an older psd)
        self._run_id = self._lib.psw_client_run_id(self._c)
        self.batch_size = a.batch_size
        self.val_batch_size = a.val_batch_size
        self._timeout = max(a.step_timeout_s, 1.0)
        self._start_timeout = max(a.start_timeout_s, 1.0)
        self._offsets = [a.tensors[k].offset for k in range(a.n_tensors)]
        if a.ctr.table_on_psd:
            self._lib.psw_client_destroy(ctypes.byref(self._c))
            self._c = None
            raise RunError("psd keeps the embedding table and sends rows only: not with psd.torch", 2)
        self._region = self._lib.psw_client_push_region(self._c)
        if self._staged:
            self._region = None  # the gradients are staged in host buffers of their own
            if self._stg is None:
                self._stg = Staging(self._table, self._offsets)
        self._rows_ok = bool(self._lib.psw_client_rows_ok(self._c))
        # the weights of an event are copied into the parameters at once: psd may reuse its slot after a push
        self._lib.psw_client_release_on_push(self._c, 1)
        if self._lib.psw_client_ready(self._c, *self._data) != 0:
            raise RunError("psd: data_id must be at most 255 printable characters", 2)
        return 0, ""

    def _check_table(self, a):
        if a.model != L.MODEL_TENSORS:
            return ("psd trains one of its built-in models: a torch worker needs model.kind from_worker "
                    "(or tensors)")
        by_name = dict(self._params)
        table = []
        for k in range(a.n_tensors):
            t = a.tensors[k]
            name = t.name.decode()
            p = by_name.get(name)
            if p is None or p.numel() != t.numel:
                return "psd: the run's tensor %d (%s, %d floats) is not one of this model's parameters" % (
                    k, name, t.numel)
            table.append((name, p))
        if self._table is not None and [x for x, _ in table] != [x for x, _ in self._table]:
            return "psd's model changed since this worker joined: not rejoining"
        self._table = table
        return ""

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
                ev = self._take(self._timeout)
                if ev.kind == L.EV_WEIGHTS:
                    self._set_weights(ev)
                    self._version = ev.version
                    self._grads_ready()
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
                ev = self._take(self._timeout)
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

    def _set_weights(self, ev):
        if self._stg is not None:
            self._stg.load([_view(ev.tensors[k], ev.tensor_numel[k]).view(p.shape)
                            for k, (_, p) in enumerate(self._table)])
            self._versions = [p._version for _, p in self._table]
            return
        with torch.no_grad():
            rows = None
            if ev.n_row_ids:  # the reply to a push with want: only those rows of the table are new
                rows = torch.frombuffer((ctypes.c_uint32 * ev.n_row_ids).from_address(
                    ctypes.cast(ev.row_ids, ctypes.c_void_p).value), dtype=torch.int32).long()
            for k, (name, p) in enumerate(self._table):
                src = self._reply_view(k, ev.tensors[k], ev.tensor_numel[k], p.shape)
                if rows is not None and name in self._sparse:
                    p.data.index_copy_(0, rows, src.index_select(0, rows))
                else:
                    p.data.copy_(src)
        self._versions = [p._version for _, p in self._table]

    def _reply_view(self, k, ptr, n, shape):
        """Tensor k of a reply as a tensor over psd's buffer: made once for each address a reply
        brings it at (psd's few parameter slots, or the client's buffer), then reused."""
        addr = ctypes.cast(ptr, ctypes.c_void_p).value
        key = (k, addr, n)
        v = self._rviews.get(key)
        if v is None:
            if len(self._rviews) > 16 * len(self._table):  # addresses of another session: start again
                self._rviews.clear()
            v = self._rviews[key] = _view(ptr, n).view(shape)
        return v

    def _grads_ready(self):
        """Before a batch: the gradients zeroed; on psd's host, each
        parameter's .grad a view of psd's push region (backward adds into
        it in place: the push copies nothing)."""
        if self._stg is not None:
            self._stg.begin()
            self._early_sent = set()
            return
        with torch.no_grad():
            if self._region:
                if self._views is None:
                    n = max(int(o) + p.numel() for o, (_, p) in zip(self._offsets, self._table))
                    self._flat = _view(ctypes.cast(self._region, L.c_float_p), n)
                    self._views = [self._flat[int(o):int(o) + p.numel()].view(p.shape)
                                   for o, (_, p) in zip(self._offsets, self._table)]
                    self._fast_push = self._fast_descriptor()
                self._flat.zero_()  # every gradient at once (and the gaps psd leaves between them)
                for (name, p), v in zip(self._table, self._views):
                    if p.grad is not v:
                        p.grad = v
            else:
                for name, p in self._table:
                    if p.grad is not None and p.grad.is_sparse:
                        p.grad = None  # backward makes the next batch's
                    elif p.grad is not None:
                        p.grad.zero_()

    def _fast_descriptor(self):
        """The push of every gradient from its shared-memory view (_push_fast), or None where a
        gradient goes another way (rows of a sparse table)."""
        if self._sparse:
            return None
        grads = (L.Grad * len(self._table))()
        for k, v in enumerate(self._views):
            grads[k].tensor = k
            grads[k].data = ctypes.cast(v.data_ptr(), L.c_float_p)
        self._fast_bytes = 4 * sum(v.numel() for v in self._views)
        self._fast_grads = grads  # kept alive with the descriptor
        return L.Push(n_grads=len(self._table), grads=grads)

    def _drop_views(self):
        """The push region is unmapped with its client: no .grad may point there then."""
        if self._views is not None:
            for (name, p), v in zip(self._table, self._views):
                if p.grad is not None and p.grad.data_ptr() == v.data_ptr():
                    p.grad = None
            self._views = None
            self._flat = None
            self._fast_push = None
        self._rviews.clear()  # another session's buffers

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
        try:
            loss, correct, count, sums = _valid.answer(split, ids, fn, self.val_batch_size,
                                                       lambda: self._lib.psw_client_heartbeat(self._c, ev.epoch))
        except _valid.ValidationError as e:
            raise RunError(str(e)) from None
        names = list(sums)
        arr = (L.Sum * max(1, len(names)))()
        for i, key in enumerate(names):
            arr[i].name = key.encode()
            arr[i].value = sums[key]
        r = L.Val(epoch=ev.epoch, version=ev.version, begin=ev.val_begin, split=ev.split, loss_sum=loss,
                  correct=correct, count=count, n_sums=len(names), sums=arr)
        rc = self._lib.psw_client_val_result(self._c, ctypes.byref(r))
        if rc in _LOST:
            return  # psd is gone: the next event says what comes (this part is validated again)
        if rc != 0:
            raise RunError("psd: a validation answer was refused (%d): named sums are 1 to 32 of [a-z0-9_], not "
                           "loss, acc, correct, count, samples or auc, at most 16, finite" % rc)

    def _shutdown(self, ev):
        self.exit_code = _exit_code_of(ev.exit_code)
        self.message = ev.message.decode(errors="replace")
        self.close()
        if self.exit_code != 0:
            raise RunError("psd ended this worker's run (exit %d): %s" % (ev.exit_code, self.message),
                           self.exit_code)

    def _join_code(self, rc):
        """The exit code for a registration that failed with rc (as pworker's)."""
        if rc == -errno.ESHUTDOWN:
            return _exit_code_of(self._ended_code)
        return 4 if rc in _LOST else 2

    def _fail(self, why):
        """Tell psd this worker fails (its own error: psd logs it as failed, not lost), and close."""
        if self._c is not None:
            self._lib.psw_client_fail(self._c, 0, why.encode(errors="replace")[:1000])
            self.close()
