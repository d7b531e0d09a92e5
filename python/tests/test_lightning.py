"""psd.lightning: Lightning Trainers as psd workers (lit_worker.py), with a real psd on loopback.
Run by the suite 'lightning' (tests/lightning.sh) with the virtual environment of
deploy/setup.sh --lightning (the 'python' suite leaves this file out)."""
import csv
import json
import os
import signal
import time

import pytest

CONFIG = """model: {kind: from_worker}
run: {epochs: %d}
train: {batch_size: 20}
"""


def lit(r, i, *args):
    return r.worker(str(r.tmp / ("w%d" % i)), *args, script="lit_worker.py")


def result(out):
    """The JSON line lit_worker.py prints at its end."""
    return json.loads([x for x in out.splitlines() if x.startswith("{")][-1])


def logged(r, rank_dir="w0"):
    """Lightning's CSV log of rank 0: its rows that have validation figures."""
    path = os.path.join(r.tmp, rank_dir, "lightning_logs", "version_0", "metrics.csv")
    return [row for row in csv.DictReader(open(path)) if row.get("val_mae")]


def close(a, b, rel=1e-6):
    return abs(a - b) <= rel * max(abs(a), abs(b))


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_lightnings_logged_validation_figures_are_psds(run, workers):
    """1, 2 and 3 Lightning workers: every epoch's val_loss, val_mae (means) and val_n (a sum)
    that Lightning logs on rank 0 are psd's metrics file's within a relative 1e-6, on every
    rank the same (its callback_metrics); psd validated every sample once; only rank 0 logged
    and wrote ModelCheckpoint's files; trainer.validate after the fit runs on this process."""
    r = run(workers, config=CONFIG % 3)
    w = [lit(r, i, "--validate-after") for i in range(workers)]
    out = [p.communicate(timeout=240) for p in w]
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    res = []
    for p, (o, e) in zip(w, out):
        assert p.returncode == 0, o + e
        res.append(result(o))
    M = r.metrics()
    assert len(M) == 3 and all(m["val_samples"] == 200 and m["train_samples"] == 1000 for m in M), M
    rows = logged(r, "w%d" % [x["rank"] for x in res].index(0))[:3]  # (then trainer.validate's)
    assert len(rows) == 3, rows
    for m, row in zip(M, rows):
        assert close(float(row["val_loss"]), m["val_loss"]), (row, m)
        assert close(float(row["val_mae"]), m["val_mae"]), (row, m)
        assert float(row["val_n"]) == 200.0, row  # a sum: psd's total
    for x in res:
        assert x["local_figures"] == 0 and x["exit_code"] == 0, x
        assert close(x["metrics"]["val_mae"], M[-1]["val_mae"]), (x, M[-1])
        assert close(x["validated"]["val_mae"], M[-1]["val_mae"], 1e-5), x  # psd's last weights, locally
    for i, x in enumerate(res):
        ck = os.path.join(r.tmp, "w%d" % i, "ckpt")
        assert os.path.isdir(ck) == (x["rank"] == 0), (i, x)
    assert M[-1]["val_mae"] < 0.6 * M[0]["val_mae"], M  # it learns


def test_early_stopping_ends_psds_run(run):
    """EarlyStopping (patience 2, min_delta larger than any gain: stops after epoch 3) ends
    psd's run of 20 epochs through the strategy: psd logs who ended it and exits 0, both
    workers exit 0 after 3 epochs."""
    r = run(2, config=CONFIG % 20)
    w = [lit(r, i, "--early-stop", "2") for i in range(2)]
    out = [p.communicate(timeout=240) for p in w]
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    for p, (o, e) in zip(w, out):
        assert p.returncode == 0, o + e
        assert result(o)["epochs"] == 3, o
    assert "ends the run" in r.psd_log(), r.psd_log()
    assert len(r.metrics()) == 3


def test_a_worker_killed_mid_epoch_the_others_finish_with_exact_counts(run):
    """3 Lightning workers (50 ms a batch), one killed with SIGKILL mid-epoch 2: the two left
    train its share; every epoch trained and validated every sample once; Lightning's figures
    are still psd's."""
    r = run(3, config=CONFIG % 4)
    w = [lit(r, i, "--sleep", "0.05") for i in range(3)]
    r.wait_log("epoch 1/4 step", timeout=120)
    time.sleep(0.4)
    w[2].send_signal(signal.SIGKILL)
    out = [p.communicate(timeout=240) for p in w]
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    assert w[2].returncode == -signal.SIGKILL
    for p, (o, e) in zip(w[:2], out[:2]):
        assert p.returncode == 0, o + e
    M = r.metrics()
    assert len(M) == 4 and all(m["train_samples"] == 1000 and m["val_samples"] == 200 for m in M), M
    assert M[-1]["workers"] == 2, M[-1]
    res = [result(o) for o, _ in out[:2]]
    for x in res:
        assert close(x["metrics"]["val_mae"], M[-1]["val_mae"]), (x, M[-1])


def test_psd_killed_and_resumed_the_workers_carry_on(run, tmp_path):
    """psd killed with SIGKILL mid-epoch 2 and started again with --resume: the Lightning
    workers register again by themselves and the run ends, every epoch's counts exact."""
    r = run(2, config=CONFIG % 4, extra=("--set", "checkpoint.dir=%s" % (tmp_path / "ck"),
                                          "--set", "checkpoint.every_steps=10"))
    w = [lit(r, i, "--sleep", "0.04") for i in range(2)]
    r.wait_log("epoch 1/4 step", timeout=120)
    time.sleep(0.5)
    r.psd.kill()
    r.psd.wait()
    r.start_psd("--resume", str(tmp_path / "ck"))
    out = [p.communicate(timeout=240) for p in w]
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    for p, (o, e) in zip(w, out):
        assert p.returncode == 0, o + e
        assert "registered again" in e, e
    M = r.metrics()
    assert [m["epoch"] for m in M][-1] == 4, M
    for m in M:
        assert m["train_samples"] == 1000 and m["val_samples"] == 200, m


def test_what_psd_cannot_do_is_refused_before_registering(run):
    """accumulate_grad_batches: a clear message and a non-zero exit, before psd hears of it."""
    r = run(1, config=CONFIG % 2)
    p = r.worker(str(r.tmp / "w0"), "--accumulate", "2", script="lit_worker.py")
    o, e = p.communicate(timeout=120)
    assert p.returncode != 0
    assert "psd.lightning: not with psd: accumulate_grad_batches" in e, e
