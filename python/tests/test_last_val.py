"""What psd tells its workers of the run (proto Epoch.last_val, Shutdown.last_val, Leave.end_run):
the figures of its last validation as its metrics file has them, and a worker that ends the run
(Lightning's EarlyStopping). Real psd and psd.torch worker scripts on loopback (conftest.py)."""
import json
import math
import re

import pytest


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-8, abs_tol=1e-12)  # the metrics file prints 9 digits


def same_figures(lv, m, prefix):
    """A worker's last_val against the metrics line m's <prefix>loss, acc, correct, samples, NAME."""
    n = lv["count"]
    assert n == m[prefix + "samples"] and lv["correct"] == m[prefix + "correct"], (lv, m)
    assert close(lv["loss_sum"] / n, m[prefix + "loss"]) and close(lv["correct"] / n, m[prefix + "acc"]), (lv, m)
    assert list(lv["sums"]) == ["abs_err"], lv  # the worker's evaluate(): its one named sum
    assert close(lv["sums"]["abs_err"] / n, m[prefix + "abs_err"]), (lv, m)


def test_workers_get_the_figures_of_psds_metrics_file(run, tmp_path):
    """Both workers get, with each EPOCH, the epoch before's figures as the metrics file has them;
    with the SHUTDOWN the closing test's (data.val_fraction: a held-out split)."""
    r = run(2)
    w = [r.worker("--last-val", str(tmp_path / ("lv%d" % i))) for i in range(2)]
    out = [p.communicate(timeout=180) for p in w]
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    assert [p.returncode for p in w] == [0, 0], out
    m = r.metrics()
    assert len(m) == 3 and "test_loss" in m[-1], m
    for i in range(2):
        got = [json.loads(x) for x in (tmp_path / ("lv%d" % i)).read_text().splitlines()]
        assert len(got) == 4, got  # after each of the 3 epochs, and at the end
        for e in range(2):  # epochs 1 and 2: the held-out split's, told with the next EPOCH
            assert (got[e]["epoch"], got[e]["split"], got[e]["final"]) == (e, "val", False), got[e]
            same_figures(got[e], m[e], "val_")
        # epoch 3's validation, then the closing test: the SHUTDOWN tells the test's
        assert got[2] == got[3], got
        assert (got[3]["epoch"], got[3]["split"], got[3]["final"]) == (2, "test", True), got[3]
        same_figures(got[3], m[2], "test_")


@pytest.mark.parametrize("ckpt", [False, True])
def test_a_worker_ends_the_run(run, tmp_path, ckpt):
    """One worker ends the run after epoch 1 of 3 (w._s.end_run, as Lightning's EarlyStopping
    would): psd logs it, stops as on psctl stop (its checkpoint where configured), the other
    worker gets SHUTDOWN exit 0, everyone exits 0; the metrics file has epoch 1's line."""
    ck = tmp_path / "ck"
    r = run(2, extra=("--set", "checkpoint.dir=%s" % ck) if ckpt else ())
    ender = r.worker("--end-run-after", "1")
    r.wait_log("worker registered")  # the ender is one of the two, whichever its rank
    other = r.worker("--verbose", "--slow", "0.01")
    out = [p.communicate(timeout=180) for p in (ender, other)]
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    assert [ender.returncode, other.returncode] == [0, 0], out
    assert "exit_code 0" in out[1][0], out[1]  # the other's w.exit_code: psd's SHUTDOWN code
    log = r.psd_log()
    assert re.search(r"rank [01] ends the run: test", log), log
    assert "no workers left" not in log, log
    m = r.metrics()
    assert [x["epoch"] for x in m] == [1], m
    if ckpt:
        assert list(ck.glob("run-*/ckpt-*")), log
