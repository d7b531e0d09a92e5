"""A torch worker's run with psd: joining it, its events, losing psd and coming back, its end.

Session holds the worker library's client (libpsworker.so.3 through ctypes) for one
worker: it offers the model's parameters and the optimizer's config text, registers,
checks the run's table against the parameters, says the data's sizes and fingerprint;
hands out psd's events one at a time; when psd is lost (killed, restarted, silent) it
registers again for up to retry_s seconds; and it says what a run's end means for the
worker's exit code (README "Exit codes": psd's code where psd ended it, 4 when psd is
lost for good, 2 when refused). It knows nothing of batches, gradients or validation:
psd.torch.Worker owns it and those (python/tests/test_session.py tests it alone, on a
stand-in for the library).
"""
import ctypes
import errno
import os
import socket
import sys
import time

from . import _lib as L

LOST = (-errno.ETIMEDOUT, -errno.ECONNRESET, -errno.ENOLINK)


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


def exit_code_of(psd_code):
    """A worker's exit code for the code psd ended the run with (as pworker's)."""
    return psd_code if 0 <= psd_code <= 125 else 1


class End:
    """SHUTDOWN that psd gave while this worker registered again."""
    kind = L.EV_SHUTDOWN
    append = 0

    def __init__(self, code, message):
        self.exit_code = code
        self.message = message.encode()


class Session:
    """One worker's client of psd at endpoint. params: the model's [(name, parameter)] (offered,
    and checked against the run's table); sparse: the names offered as sparse rows; data:
    (train_size, test_size, data_id bytes); offer: the optimizer's config text (bytes) or None;
    keys: CurveZMQ keys (three buffers) or None; leaving(): SIGTERM came (no registering
    again then). After join(): rank, run_id, table (the run's tensors in its order: (name,
    parameter)), offsets, region (psd's push region or None), rows_ok, batch_size,
    val_batch_size, timeout, start_timeout, world; rejoins counts the times psd came back.
    last_val: psd's last finished validation of the run, as the latest EPOCH or SHUTDOWN event
    brought it (None until one did): {"epoch": int (0-based), "split": "val" | "test", "final":
    bool (the run's closing test), "count": int, "loss_sum": float, "correct": int, "sums":
    {name: float}}, the whole set's sums as psd reduced them for its metrics line (val_loss =
    loss_sum / count, val_acc = correct / count, val_NAME = sums[NAME] / count)."""

    def __init__(self, lib, endpoint, params, sparse=(), data=(0, 0, b""), threads=0, shared_memory=True, keys=None,
                 offer=None, retry_s=120.0, leaving=lambda: False, bf16_given=False):
        self.lib = lib
        self.bf16_given = bf16_given  # bfloat16 on the wire is converted by the caller (staged parameters)
        self.endpoint = endpoint
        self.params = params
        self.sparse = set(sparse)
        self.data = data
        self.threads = threads
        self.shared_memory = shared_memory
        self.keys = keys
        self.offer = offer
        self.retry_s = retry_s
        self.leaving = leaving
        self.identity = ctypes.create_string_buffer(16)
        lib.psw_make_identity(self.identity, id(self) ^ os.getpid())
        self.c = None
        self.run_id = 0
        self.rank = 0
        self.world = 1
        self.table = None
        self.offsets = None
        self.region = None
        self.rows_ok = False
        self.wire16 = (False, False)  # the run's gradients, weights go as bfloat16
        self.rejoins = 0
        self.ended_code = 0  # psd's code when a registration was answered with SHUTDOWN
        self.last_val = None
        self._ev = [L.Event(), L.Event()]  # alternated: an event stays valid until the next call but one
        self._ev_i = 0

    def join(self, timeout):
        """The first registration: RunError (with the exit code pworker would have) if it fails."""
        rc, msg = self._register(timeout)
        if rc != 0:
            raise RunError("psd: cannot join the run at %s: %s" % (self.endpoint, msg), self.join_code(rc))

    def next(self, timeout, on_lost=None, on_back=None):
        """psd's next event; None when a signal interrupted the wait (the caller looks at what
        it set and asks again). psd lost: on_lost(), registering again (retry_s), on_back()
        once back (the events that follow are the epoch trained now), or End if psd ended
        the run meanwhile."""
        if self.c is None:
            raise RunError("psd: this worker has left the run")
        err = ctypes.create_string_buffer(512)
        while True:
            self._ev_i ^= 1
            ev = self._ev[self._ev_i]
            rc = self.lib.psw_client_next(self.c, ctypes.byref(ev), timeout, err, 512)
            if rc == -errno.EINTR:
                return None
            if rc in LOST:
                if on_lost is not None:
                    on_lost()
                end = self._lost(err.value.decode(errors="replace"))
                if end is not None:
                    return end
                if on_back is not None:
                    on_back()
                timeout = self.start_timeout
                continue
            if rc != 0:
                msg = err.value.decode(errors="replace")
                self.destroy()
                raise RunError("psd: %s (%d)" % (msg or "no answer", rc), 1)
            self._take_last_val(ev)
            return ev

    def poll(self):
        """An event psd already sent, looked for in 2 ms: (0, event), (-ETIMEDOUT, None) when none
        came, or (rc, None) where the wait failed (psd lost: rc in LOST)."""
        if self.c is None:
            return -errno.ENOLINK, None
        err = ctypes.create_string_buffer(512)
        self._ev_i ^= 1
        ev = self._ev[self._ev_i]
        rc = self.lib.psw_client_next(self.c, ctypes.byref(ev), 0.002, err, 512)
        if rc == 0:
            self._take_last_val(ev)
        return rc, ev if rc == 0 else None

    def _take_last_val(self, ev):
        """The figures an EPOCH or SHUTDOWN event carries into last_val, copied now: their names are
        the library's until its next event."""
        if not getattr(ev, "has_last_val", 0):
            return
        v = ev.last_val
        self.last_val = {"epoch": int(v.epoch), "split": "val" if v.split == L.SPLIT_VAL else "test",
                         "final": bool(ev.last_val_final), "count": int(v.count), "loss_sum": float(v.loss_sum),
                         "correct": int(v.correct),
                         "sums": {v.sums[i].name.decode(): float(v.sums[i].value) for i in range(v.n_sums)}}

    def lost(self, why, on_lost=None, on_back=None):
        """psd was lost outside next() (a push failed): as next() does; None once back, or End."""
        if on_lost is not None:
            on_lost()
        end = self._lost(why)
        if end is None and on_back is not None:
            on_back()
        return end

    def _lost(self, why):
        print("psd: worker %d lost psd (%s): registering again for up to %.0f s" % (self.rank, why, self.retry_s),
              file=sys.stderr, flush=True)
        self.destroy()
        start, pause = time.monotonic(), 0.25
        while True:
            if self.leaving():
                raise SystemExit(0)
            time.sleep(pause)
            pause = min(pause * 2, 5.0)
            rc, msg = self._register(5.0)
            if rc == 0:
                self.rejoins += 1
                print("psd: worker %d registered again (rank %d)" % (self.rank, self.rank), file=sys.stderr,
                      flush=True)
                return None
            if rc == -errno.ESHUTDOWN:
                return End(self.ended_code, msg)
            if rc not in LOST:
                raise RunError("psd: cannot join the run again: %s" % msg, self.join_code(rc))
            if time.monotonic() - start > self.retry_s:
                raise RunError("psd at %s did not come back within %.0f s" % (self.endpoint, self.retry_s), 4)

    def _register(self, timeout):
        """A client, registered, its table checked, its data said. Returns (0, "") or
        (-errno, why); RunError where this worker cannot be in the run at all."""
        lib = self.lib
        n = len(self.params)  # offered again when registering again: psd checks it against the run's
        offer = (L.Tensor * n)()
        values = (L.c_float_p * n)()
        hosts = []
        for i, (name, p) in enumerate(self.params):
            offer[i].name = name.encode()
            offer[i].sparse_rows = 1 if name in self.sparse else 0
            offer[i].ndim = p.dim()
            for d, s in enumerate(p.shape):
                offer[i].shape[d] = s
            host = p.detach() if p.device.type == "cpu" else p.detach().to("cpu")
            hosts.append(host)  # read during the registration only
            values[i] = ctypes.cast(host.data_ptr(), L.c_float_p)
        info = L.Info(device=b"cpu", device_index=-1, threads=self.threads, n_offer=n, offer=offer,
                      offer_values=values, identity=ctypes.cast(self.identity, ctypes.c_void_p), identity_len=16,
                      no_shm=0 if self.shared_memory else 1, identity_hint=socket.gethostname().encode(),
                      run_id=self.run_id, prev_rank=self.rank)
        if self.keys:
            info.curve_public, info.curve_secret, info.curve_server = (k.value for k in self.keys)
        err = ctypes.create_string_buffer(512)
        c = lib.psw_client_new(self.endpoint.encode(), ctypes.byref(info), err, 512)
        if not c:
            return -errno.EINVAL, err.value.decode(errors="replace")
        self.c = ctypes.c_void_p(c)
        if self.offer and lib.psw_client_offer_config(self.c, self.offer, err, 512) != 0:  # each registration
            self.destroy()
            return -errno.EINVAL, err.value.decode(errors="replace")
        lib.psw_client_bf16_given(self.c, 1 if self.bf16_given else 0)
        a = L.Assign()
        rc = lib.psw_client_register(self.c, ctypes.byref(a), timeout, err, 512)
        if rc != 0:
            self.ended_code = lib.psw_client_shutdown_code(self.c)
            self.destroy()
            return rc, err.value.decode(errors="replace")
        why = self._check_table(a)
        if why:
            self.fail(why)
            raise RunError(why, 2)
        self.rank = a.rank
        self.world = a.world or 1  # psd's workers until an EPOCH says (0: an older psd)
        self.run_id = lib.psw_client_run_id(self.c)
        self.batch_size = a.batch_size
        self.val_batch_size = a.val_batch_size
        self.timeout = max(a.step_timeout_s, 1.0)
        self.start_timeout = max(a.start_timeout_s, 1.0)
        self.offsets = [a.tensors[k].offset for k in range(a.n_tensors)]
        if a.ctr.table_on_psd:
            self.destroy()
            raise RunError("psd keeps the embedding table and sends rows only: not with psd.torch", 2)
        self.region = lib.psw_client_push_region(self.c)
        self.rows_ok = bool(lib.psw_client_rows_ok(self.c))
        g16, w16 = ctypes.c_int(), ctypes.c_int()
        lib.psw_client_wire_bf16(self.c, ctypes.byref(g16), ctypes.byref(w16))
        self.wire16 = (bool(g16.value), bool(w16.value))
        # the weights of an event are copied into the parameters at once: psd may reuse its slot after a push
        lib.psw_client_release_on_push(self.c, 1)
        if lib.psw_client_ready(self.c, *self.data) != 0:
            raise RunError("psd: data_id must be at most 255 printable characters", 2)
        return 0, ""

    def _check_table(self, a):
        if a.model != L.MODEL_TENSORS:
            return ("psd trains one of its built-in models: a torch worker needs model.kind from_worker "
                    "(or tensors)")
        by_name = dict(self.params)
        table = []
        for k in range(a.n_tensors):
            t = a.tensors[k]
            name = t.name.decode()
            p = by_name.get(name)
            if p is None or p.numel() != t.numel:
                return "psd: the run's tensor %d (%s, %d floats) is not one of this model's parameters" % (
                    k, name, t.numel)
            table.append((name, p))
        if self.table is not None and [x for x, _ in table] != [x for x, _ in self.table]:
            return "psd's model changed since this worker joined: not rejoining"
        self.table = table
        return ""

    def join_code(self, rc):
        """The exit code for a registration that failed with rc (as pworker's)."""
        if rc == -errno.ESHUTDOWN:
            return exit_code_of(self.ended_code)
        return 4 if rc in LOST else 2

    def fail(self, why):
        """Tell psd this worker fails (its own error: psd logs it as failed, not lost); the client goes."""
        if self.c is not None:
            self.lib.psw_client_fail(self.c, 0, why.encode(errors="replace")[:1000])
            self.destroy()

    def leave(self, reason):
        """Leave the run (psd gives this worker's samples to the others); the client goes."""
        if self.c is not None:
            self.lib.psw_client_leave(self.c, reason.encode())
            self.destroy()

    def end_run(self, reason):
        """End the whole run (this worker's framework stops it: an early stop, its own epoch count): this
        worker leaves, and psd ends the run as psctl stop does (a checkpoint where configured, SHUTDOWN
        exit 0 to the others); the client goes."""
        if self.c is not None:
            self.lib.psw_client_end_run(self.c, reason.encode())
            self.destroy()

    def weights16(self):
        """With bf16_given and bfloat16 weights: the address of the last event's weights as psd
        sent them (the model's bfloat16 values in psd's layout), else None."""
        if self.c is None or not (self.bf16_given and self.wire16[1]):
            return None
        return self.lib.psw_client_weights_bf16(self.c)

    def destroy(self):
        if self.c is not None:
            self.lib.psw_client_destroy(ctypes.byref(self.c))
            self.c = None
