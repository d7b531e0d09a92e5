"""psd.ignite: Ignite trainers as psd workers (ign_worker.py), with a real psd on loopback, and
the example (examples/ignite). Run by the suite 'ignite' (tests/lightning.sh test_ignite.py)
with the virtual environment of deploy/setup.sh --lightning (the 'python' suite leaves this
file out)."""
import difflib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import FRAMEWORK_CONFIG as CONFIG, HERE, close, free_port, result

ROOT = os.path.dirname(os.path.dirname(HERE))
def ign(r, i, *args):
    return r.worker(str(r.tmp / ("w%d" % i)), *args, script="ign_worker.py")


def same_as_psd(seen, M):
    """The evaluator's metrics each epoch are psd's metrics file's (RMSE: the root of psd's
    mean of squares)."""
    assert len(seen) == len(M), (seen, M)
    for s, m in zip(seen, M):
        assert s["epoch"] == m["epoch"], (s, m)
        assert close(s["loss"], m["val_loss"]) and close(s["mae"], m["val_mae"]), (s, m)
        assert close(s["rmse"], math.sqrt(m["val_rmse_sq"])), (s, m)


@pytest.mark.parametrize("workers", [1, 3])
def test_the_evaluators_metrics_are_psds_exact_figures_on_every_rank(run, workers):
    """1 and 3 Ignite workers: every epoch the evaluator's Loss, MeanAbsoluteError and
    RootMeanSquaredError are psd's figures over every worker's parts (its metrics file, within
    1e-6), the same on every rank; every sample trained and validated once an epoch; the
    optimizer, scheduler and clipping the train step reads were psd's; only rank 0's
    Checkpoint wrote; psd's epochs end the trainer (exit 0)."""
    r = run(workers, config=CONFIG % 3)
    w = [ign(r, i) for i in range(workers)]
    out = [p.communicate(timeout=240) for p in w]
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    M = r.metrics()
    assert len(M) == 3 and all(m["val_samples"] == 200 and m["train_samples"] == 1000 for m in M), M
    res = []
    for i, (p, (o, e)) in enumerate(zip(w, out)):
        assert p.returncode == 0, o + e
        x = result(o)
        res.append(x)
        assert x["epochs"] == 3 and x["local_figures"] == 0 and x["exit_code"] == 0, x
        same_as_psd(x["seen"], M)
        ck = os.path.join(r.tmp, "w%d" % i, "ckpt")
        files = os.listdir(ck) if os.path.isdir(ck) else []  # (DiskSaver makes its directory on every rank)
        assert len(files) == (1 if x["rank"] == 0 else 0), (i, x, files)
        assert "clip_grad_norm_ is skipped" in o or x["rank"] != 0, o
    assert sorted(x["rank"] for x in res) == list(range(workers))
    assert all(x["steps"] > 0 for x in res), res
    assert M[-1]["val_loss"] < 0.3 * M[0]["val_loss"], M  # it learns
    log = r.psd_log()  # the optimizer, scheduler and clipping of the train step, psd's
    for line in ("optimizer.name: sgd (worker)", "optimizer.momentum: 0.9 (worker)", "optimizer.clip_norm: 0.5 (worker)",
                 'schedule.torch: "StepLR(step_size=100, gamma=0.5)" (worker)', "schedule.interval: step (worker)"):
        assert line in log, (line, log)


def test_the_trainer_ending_first_ends_psds_run(run):
    """max_epochs 2 of psd's 20, then EarlyStopping (patience 2, a min_delta no gain reaches:
    stops after epoch 3): each time psd logs who ended its run and exits 0, the workers exit 0
    after that many epochs."""
    for args, epochs in ((("--epochs", "2"), 2), (("--early-stop", "2"), 3)):
        r = run(2, config=CONFIG % 20)
        w = [ign(r, i, *args) for i in range(2)]
        out = [p.communicate(timeout=240) for p in w]
        assert r.psd.wait(timeout=60) == 0, r.psd_log()
        for p, (o, e) in zip(w, out):
            assert p.returncode == 0, o + e
            assert result(o)["epochs"] == epochs, o
        assert "ends the run" in r.psd_log(), r.psd_log()
        assert len(r.metrics()) == epochs
        r.kill()
        (r.tmp / "m.jsonl").unlink()


def test_a_worker_killed_mid_epoch_the_others_finish_with_exact_counts(run):
    """3 Ignite workers (20 ms a batch), one killed with SIGKILL mid-epoch 2: the two left
    train its share; every epoch trained and validated every sample once; their evaluators'
    figures are still psd's."""
    r = run(3, config=CONFIG % 4)
    w = [ign(r, i, "--sleep", "0.02") for i in range(3)]
    r.wait_log("epoch 1/4 step", timeout=120)
    time.sleep(0.3)
    w[2].send_signal(signal.SIGKILL)
    out = [p.communicate(timeout=240) for p in w]
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    assert w[2].returncode == -signal.SIGKILL
    M = r.metrics()
    assert len(M) == 4 and all(m["train_samples"] == 1000 and m["val_samples"] == 200 for m in M), M
    assert M[-1]["workers"] == 2, M[-1]
    for p, (o, e) in zip(w[:2], out[:2]):
        assert p.returncode == 0, o + e
        same_as_psd(result(o)["seen"], M)


def test_psd_killed_and_resumed_the_workers_carry_on(run, tmp_path):
    """psd killed with SIGKILL mid-epoch 2 and started again with --resume: the Ignite workers
    register again by themselves and the run ends; every epoch's counts exact; the trainer's
    epochs are psd's (an epoch psd trains again is the same epoch number)."""
    r = run(2, config=CONFIG % 4, extra=("--set", "checkpoint.dir=%s" % (tmp_path / "ck"),
                                          "--set", "checkpoint.every_steps=10"))
    w = [ign(r, i, "--sleep", "0.02", "--epochs", "4") for i in range(2)]
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
        assert result(o)["epochs"] == 4, o
    M = r.metrics()
    assert [m["epoch"] for m in M][-1] == 4, M
    for m in M:
        assert m["train_samples"] == 1000 and m["val_samples"] == 200, m


@pytest.mark.parametrize("args,says", [
    (("--attach-clip", "1.0"), "clips the gradient to 0.5: psd clips the reduced gradient"),
    (("--attach-clip", "0"), "give attach(clip_norm=0.5)"),
    (("--interval", "epoch"), "the scheduler is stepped in the train step: give attach(scheduler_interval='step')"),
    (("--metric", "precision"), "metric 'precision' (Precision)"),
])
def test_what_psd_cannot_do_exactly_is_refused(run, args, says):
    """Clipping locally to another norm than psd's (or without telling psd), a scheduler stepped
    where attach() was not told, a metric psd cannot add up: one line saying why, exit 2."""
    r = run(1, config=CONFIG % 2)
    p = ign(r, 0, *args)
    o, e = p.communicate(timeout=120)
    assert p.returncode == 2, o + e
    assert says in e, e


def test_the_example_differs_from_the_single_process_only_where_the_readme_says():
    """examples/ignite/autoencoder_psd.py is autoencoder.py with lines added, none changed or
    removed, and every added line is in the README's "From Lightning or Ignite" section."""
    a = open(os.path.join(ROOT, "examples", "ignite", "autoencoder.py")).read().splitlines()
    b = open(os.path.join(ROOT, "examples", "ignite", "autoencoder_psd.py")).read().splitlines()
    diff = [d for d in difflib.ndiff(a, b) if d[:2] in ("+ ", "- ")]
    assert not [d for d in diff if d.startswith("- ")], diff
    added = [d[2:].strip() for d in diff if d[2:].strip()]
    assert added, diff
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("## From Lightning or Ignite"):]
    section = section[:section.index("\n## ", 3)]
    for line in added:
        assert line in section, (line, section)


def test_the_readmes_commands_psd_within_2_percent_of_the_single_process():
    """The README's two Ignite commands as written (3 epochs on 12000 images; psd on a free
    port): the autoencoder alone (batch 64), then `sh deploy/quickstart.sh ignite ...`, psd +
    2 workers (psd.yaml: batch 32 each, the same 64 a step): the validation loss through psd
    within 2% of the single process's, the same on both workers and in psd's metrics file;
    only rank 0 wrote a checkpoint (on another stack, PSD_LIGHTNING_PY, its Python runs both)."""
    env = dict(os.environ, PSD_PORT=str(free_port()))
    env.pop("PYTHONPATH", None)  # the single process needs no psd
    py = ".venv/bin/python"
    if os.environ.get("PSD_LIGHTNING_PY"):  # the suite on another stack (tests/lightning.sh): its Python
        py = env["PSD_PY"] = sys.executable
    args = ["--epochs", "3", "--train-limit", "12000"]
    s = subprocess.run([py, "examples/ignite/autoencoder.py", *args, "--out", "runs/single"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    shutil.rmtree(os.path.join(ROOT, "runs", "single"), ignore_errors=True)
    assert s.returncode == 0, s.stdout + s.stderr
    q = subprocess.run(["sh", "deploy/quickstart.sh", "ignite", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    run_dir = os.path.join(ROOT, "run", "ignite")
    try:
        assert q.returncode == 0, q.stdout[-3000:] + q.stderr[-3000:]
        M = [json.loads(x) for x in open(os.path.join(run_dir, "autoencoder-metrics.jsonl"))]
        ck = [d for d in ("w0", "w1") if os.path.isdir(os.path.join(run_dir, d)) and os.listdir(os.path.join(run_dir, d))]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    res = lambda text: [dict(kv.split("=") for kv in x.split()[1:]) for x in text.splitlines()
                        if x.startswith("RESULT ")]
    single, (a, b) = res(s.stdout)[-1], res(q.stdout)
    v1, v2 = float(single["val_loss"]), float(a["val_loss"])
    print("val_loss after 3 epochs: single %.6f, psd + 2 workers %.6f (%+.2f%%)" % (v1, v2, 100 * (v2 / v1 - 1)))
    assert abs(v2 / v1 - 1) <= 0.02, (single, a)
    # psd's figure, as the RESULT line prints it (6 decimals: within half of the last one)
    assert a["val_loss"] == b["val_loss"] and abs(v2 - M[-1]["val_loss"]) <= 5.01e-7, (a, b, M[-1])
    assert len(M) == 3 and M[-1]["train_samples"] == 12000 and M[-1]["val_samples"] == 10000, M
    assert len(ck) == 1, ck
