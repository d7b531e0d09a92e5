"""psd.torch's run with psd (psd/_session.py) alone, on a stand-in for the worker library: joining
(the run's table against the model's parameters, psd's refusals and their exit codes), the
events, losing psd and registering again for retry_s (back, ended by psd meanwhile, not back:
exit 4, SIGTERM meanwhile), a signal during a wait."""
import ctypes
import errno

import pytest
import torch

from psd import _lib as L
from psd._session import End, RunError, Session


class FakeLib:
    """The calls Session makes of libpsworker, answered from scripted lists: register (an rc
    each; 0 fills the ASSIGN from `table`), next (an rc or an event kind each)."""

    def __init__(self, table, register=(0,), next_=(), shutdown_code=0):
        self.table = table  # [(name, numel)] of the run, in psd's order
        self.register = list(register)
        self.next = list(next_)
        self.shutdown_code = shutdown_code
        self.calls = []
        self.live = 0  # clients made and not destroyed

    def psw_make_identity(self, buf, seed):
        buf.raw = b"x" * 16

    def psw_client_new(self, ep, info, err, n):
        self.live += 1
        self.calls.append("new")
        return 1234

    def psw_client_offer_config(self, c, text, err, n):
        self.calls.append("offer")
        return 0

    def psw_client_register(self, c, aref, timeout, err, n):
        rc = self.register.pop(0) if self.register else 0
        self.calls.append("register %d" % rc)
        if rc != 0:
            err.value = b"psd says no"
            return rc
        a = aref._obj
        a.rank, a.world, a.model, a.batch_size, a.val_batch_size = 3, 2, L.MODEL_TENSORS, 32, 64
        a.step_timeout_s, a.start_timeout_s = 10.0, 20.0
        self._tensors = (L.Tensor * len(self.table))()
        off = 0
        for k, (name, numel) in enumerate(self.table):
            self._tensors[k].name = name.encode()
            self._tensors[k].numel = numel
            self._tensors[k].offset = off
            off += numel + 4
        a.n_tensors, a.tensors = len(self.table), self._tensors
        return 0

    def psw_client_shutdown_code(self, c):
        return self.shutdown_code

    def psw_client_destroy(self, cref):
        self.live -= 1
        self.calls.append("destroy")

    def psw_client_fail(self, c, code, why):
        self.calls.append("fail " + why.decode())

    def psw_client_leave(self, c, why):
        self.calls.append("leave " + why.decode())

    def psw_client_run_id(self, c):
        return 77

    def psw_client_push_region(self, c):
        return None

    def psw_client_rows_ok(self, c):
        return 1

    def psw_client_release_on_push(self, c, on):
        pass

    def psw_client_bf16_given(self, c, on):
        pass

    def psw_client_wire_bf16(self, c, grads, weights):  # float32 on the wire
        pass

    def psw_client_weights_bf16(self, c):
        return None

    def psw_client_ready(self, c, train, test, data_id):
        self.calls.append("ready %d %d %s" % (train, test, data_id.decode()))
        return 0

    def psw_client_next(self, c, evref, timeout, err, n):
        x = self.next.pop(0)
        if x < 0:
            err.value = b"lost the connection"
            return x
        evref._obj.kind = x
        return 0


def model():
    m = torch.nn.Linear(3, 2)
    return list(m.named_parameters())


def session(lib, **kw):
    return Session(lib, "tcp://127.0.0.1:1", model(), data=(100, 10, b"d1"), **kw)


def test_joining_takes_the_runs_table_in_its_order_and_says_the_data():
    lib = FakeLib([("bias", 2), ("weight", 6)])
    s = session(lib, offer=b"optimizer: {name: sgd}\n")
    s.join(5.0)
    assert (s.rank, s.world, s.run_id, s.batch_size, s.timeout, s.start_timeout) == (3, 2, 77, 32, 10.0, 20.0)
    assert [n for n, _ in s.table] == ["bias", "weight"] and s.offsets == [0, 6]
    assert lib.calls == ["new", "offer", "register 0", "ready 100 10 d1"]
    assert s.rows_ok and s.region is None


def test_a_run_of_another_model_is_refused_here_exit_2_and_psd_told():
    lib = FakeLib([("weight", 6), ("other", 5)])
    s = session(lib)
    with pytest.raises(RunError) as e:
        s.join(5.0)
    assert e.value.exit_code == 2 and "(other, 5 floats) is not one of this model's parameters" in str(e.value)
    assert any(c.startswith("fail psd: the run's tensor 1 (other") for c in lib.calls) and lib.live == 0


def test_psds_refusal_at_joining_is_its_exit_code():
    s = session(FakeLib([("weight", 6), ("bias", 2)], register=(-errno.ESHUTDOWN,), shutdown_code=3))
    with pytest.raises(RunError) as e:
        s.join(5.0)
    assert e.value.exit_code == 3 and "cannot join the run at tcp://127.0.0.1:1: psd says no" in str(e.value)
    s = session(FakeLib([("weight", 6), ("bias", 2)], register=(-errno.EPROTO,)))
    with pytest.raises(RunError) as e:
        s.join(5.0)
    assert e.value.exit_code == 2


def test_psd_lost_and_back_the_events_go_on_after_registering_again():
    lib = FakeLib([("weight", 6), ("bias", 2)], register=(0, -errno.ECONNRESET, 0),
                  next_=(L.EV_EPOCH, -errno.ECONNRESET, L.EV_WEIGHTS))
    s = session(lib)
    s.join(5.0)
    seen = []
    assert s.next(1.0).kind == L.EV_EPOCH
    ev = s.next(1.0, on_lost=lambda: seen.append("lost"), on_back=lambda: seen.append("back"))
    assert ev.kind == L.EV_WEIGHTS and seen == ["lost", "back"] and s.rejoins == 1
    assert lib.calls.count("destroy") == 2 and lib.live == 1, "one client at a time"


def test_psd_not_back_within_retry_s_is_exit_4():
    lib = FakeLib([("weight", 6), ("bias", 2)], register=(0,) + (-errno.ETIMEDOUT,) * 10,
                  next_=(-errno.ECONNRESET,))
    s = session(lib, retry_s=0.3)
    s.join(5.0)
    with pytest.raises(RunError) as e:
        s.next(1.0)
    assert e.value.exit_code == 4 and "did not come back within 0 s" in str(e.value)


def test_psd_ending_the_run_while_the_worker_registers_again_is_an_end():
    lib = FakeLib([("weight", 6), ("bias", 2)], register=(0, -errno.ESHUTDOWN), next_=(-errno.ENOLINK,),
                  shutdown_code=5)
    s = session(lib)
    s.join(5.0)
    ev = s.next(1.0)
    assert isinstance(ev, End) and ev.kind == L.EV_SHUTDOWN and ev.exit_code == 5


def test_sigterm_while_psd_is_lost_ends_the_worker_at_once_and_a_signal_returns_none():
    leaving = []
    lib = FakeLib([("weight", 6), ("bias", 2)], next_=(-errno.EINTR, -errno.ECONNRESET))
    s = session(lib, leaving=lambda: bool(leaving))
    s.join(5.0)
    assert s.next(1.0) is None, "a signal: the caller looks at what it set"
    leaving.append(1)
    with pytest.raises(SystemExit) as e:
        s.next(1.0)
    assert e.value.code == 0
    s.leave("bye")
    assert not any(c.startswith("leave") for c in lib.calls), "no client to leave with: psd was lost"
