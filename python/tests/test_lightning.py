"""psd.lightning: Lightning Trainers as psd workers (lit_worker.py), with a real psd on loopback.
Run by the suite 'lightning' (tests/lightning.sh) with the virtual environment of
deploy/setup.sh --lightning (the 'python' suite leaves this file out)."""
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import FRAMEWORK_CONFIG as CONFIG, HERE, close, free_port, result

def lit(r, i, *args):
    return r.worker(str(r.tmp / ("w%d" % i)), *args, script="lit_worker.py")


def logged(r, rank_dir="w0"):
    """Lightning's CSV log of rank 0: its rows that have validation figures."""
    path = os.path.join(r.tmp, rank_dir, "lightning_logs", "version_0", "metrics.csv")
    return [row for row in csv.DictReader(open(path)) if row.get("val_mae")]


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
    best = min(range(3), key=lambda e: M[e]["val_mae"])
    for i, x in enumerate(res):
        ck = os.path.join(r.tmp, "w%d" % i, "ckpt")
        assert os.path.isdir(ck) == (x["rank"] == 0), (i, x)
        # ModelCheckpoint(monitor="val_mae") on every rank picked psd's best epoch, by psd's figure
        assert x["best"].startswith("epoch=%d-" % best) and close(x["best_score"], M[best]["val_mae"]), (x, M)
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



def fit_lines(text, head):
    """fit.py's RESULT or ARGS line as a dict."""
    line = [x for x in text.splitlines() if x.startswith(head + " ")][-1]
    return dict(kv.split("=", 1) for kv in line.split()[1:])


def single_and_psd(single_args, quickstart_args, out, metrics):
    """fit.py alone (single_args, --out runs/OUT) and sh deploy/quickstart.sh quickstart_args
    (psd + 2 workers, a free port), as the README writes them: their RESULT and ARGS lines and
    psd's metrics file (on another stack, PSD_LIGHTNING_PY, its Python runs both)."""
    root = os.path.dirname(os.path.dirname(HERE))
    env = dict(os.environ, PSD_PORT=str(free_port()))
    env.pop("PYTHONPATH", None)  # the single process needs no psd
    py = ".venv/bin/python"
    if os.environ.get("PSD_LIGHTNING_PY"):  # the suite on another stack (tests/lightning.sh): its Python
        py = env["PSD_PY"] = sys.executable
    s = subprocess.run([py, "examples/lightning/fit.py"] + single_args + ["--out", "runs/" + out],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    shutil.rmtree(os.path.join(root, "runs", out), ignore_errors=True)
    assert s.returncode == 0, s.stdout + s.stderr
    run_dir = os.path.join(root, "run", quickstart_args[0])
    shutil.rmtree(run_dir, ignore_errors=True)  # (psd appends to a metrics file it finds)
    q = subprocess.run(["sh", "deploy/quickstart.sh"] + quickstart_args, cwd=root, env=env,
                       capture_output=True, text=True, timeout=900)
    try:
        assert q.returncode == 0, q.stdout[-3000:] + q.stderr[-3000:]
        M = [json.loads(x) for x in open(os.path.join(run_dir, metrics))]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    a, b = fit_lines(s.stdout, "RESULT"), fit_lines(q.stdout, "RESULT")
    assert a["mode"] == "single" and b["mode"] == "psd" and a["epochs"] == b["epochs"], (a, b)
    mae_single, mae_psd = float(a["val_mae"]), float(b["val_mae"])
    print("%s: val_mae after %s epochs: single %.5f, psd + 2 workers %.5f (%+.2f%%)" %
          (quickstart_args[0], a["epochs"], mae_single, mae_psd, 100 * (mae_psd / mae_single - 1)))
    assert abs(mae_psd / mae_single - 1) <= 0.02, (a, b)
    places = len(b["val_mae"].split(".")[1])  # RESULT's rounding
    assert len(M) == int(a["epochs"]) and abs(mae_psd - M[-1]["val_mae"]) <= 0.51 * 10 ** -places, M[-1]
    return fit_lines(s.stdout, "ARGS"), fit_lines(q.stdout, "ARGS"), M


def test_the_examples_readme_commands_psd_within_2_percent_of_the_single_trainer():
    """The README's two Lightning commands as written (2 epochs; psd on a free port): the DCRNN
    alone (batch 64), then `sh deploy/quickstart.sh lightning --epochs 2`, psd + 2 workers
    (psd.yaml: batch 32 each, the same 64 a step): the validation MAE through psd is within 2%
    of the single process's, and psd's metrics file holds it; fit.py's arguments in the two
    runs differ in --psd (the strategy) and --out only, and traffic.py, the module and data
    both import, has no psd in it."""
    x, y, M = single_and_psd(["--epochs", "2"], ["lightning", "--epochs", "2"], "single", "dcrnn-metrics.jsonl")
    assert M[-1]["val_samples"] == 275 and M[-1]["train_samples"] == 2001, M
    assert {k for k in x if x[k] != y[k]} == {"psd", "out", "epochs"}, (x, y)  # (epochs: psd's rule, 1000 a bound)
    root = os.path.dirname(os.path.dirname(HERE))
    src = open(os.path.join(root, "examples", "lightning", "traffic.py")).read()
    assert "import psd" not in src and "from psd" not in src


def test_the_weather_forecasters_readme_commands_psd_within_2_percent_of_the_single_trainer():
    """The graph weather forecaster (weather.py's mesh network, 16 epochs, its cosine schedule
    spanning them), as the README writes it: alone (batch 16), then `sh deploy/quickstart.sh
    weather` (weather.yaml: psd + 2 workers, batch 8 each): the validation MAE through psd is
    within 2% of the single process's; psd counted every training and validation pair each
    epoch; fit.py's arguments differ in --psd and --out only, and weather.py has no psd in it.
    (On the torch 1.13 stack only: 70 s; the other stack's psd.lightning has the DCRNN's.)"""
    if os.environ.get("PSD_LIGHTNING_PY"):
        pytest.skip("the README's stack only (the DCRNN's comparison runs on this one)")
    x, y, M = single_and_psd(["--model", "weather"], ["weather"], "wsingle", "weather-metrics.jsonl")
    assert all(m["val_samples"] == 184 and m["train_samples"] == 920 for m in M), M
    assert {k for k in x if x[k] != y[k]} == {"psd", "out"}, (x, y)
    root = os.path.dirname(os.path.dirname(HERE))
    src = open(os.path.join(root, "examples", "lightning", "weather.py")).read()
    assert "import psd" not in src and "from psd" not in src


def test_pip_installed_into_a_fresh_environment_the_example_trains_through_psd(run, tmp_path):
    """As usage.md's "Lightning" says: a fresh virtual environment (Debian's torch through the
    system's site packages), deploy/requirements.txt installed with pip (--no-deps,
    --require-hashes: from PyPI, or pip's cache), then psd's package (pip install ./python,
    no network); the example, run from outside the checkout with that environment's Python and
    no PYTHONPATH, trains one epoch as a psd worker. (On another stack, PSD_LIGHTNING_PY: its own
    requirements file was installed so by deploy/setup.sh --torch2; not again here.)"""
    if os.environ.get("PSD_LIGHTNING_PY"):
        pytest.skip("the Lightning 2.2.5 stack's install (the suite runs on another stack)")
    root = os.path.dirname(os.path.dirname(HERE))
    src = tmp_path / "src"  # a copy: pip builds in the directory it is given
    shutil.copytree(os.path.join(root, "python", "psd"), src / "psd", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(root, "python", "pyproject.toml"), src)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PSD_WORKER_LIB"] = os.path.join(root, "build", "libpsworker.so.3")
    venv = tmp_path / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    r = subprocess.run(pip + ["--no-deps", "--require-hashes", "-r", os.path.join(root, "deploy", "requirements.txt")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(pip + ["--no-build-isolation", "--no-index", "--no-deps", str(src)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import psd.lightning, lightning; "
                            "print(psd.lightning.__file__, lightning.__version__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True)
    assert where.returncode == 0 and where.stdout.startswith(str(venv)), where.stdout + where.stderr
    example = tmp_path / "example"
    shutil.copytree(os.path.join(root, "examples", "lightning"), example)
    r0 = run(1, config=open(example / "psd.yaml").read(), extra=("--epochs", "1"))
    w = subprocess.run([str(venv / "bin" / "python"), str(example / "fit.py"), "--epochs", "5", "--psd", r0.ep,
                        "--out", str(tmp_path / "w0")], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert w.returncode == 0, w.stdout[-2000:] + w.stderr[-3000:]
    assert r0.psd.wait(timeout=60) == 0, r0.psd_log()
    M = r0.metrics()
    assert len(M) == 1 and M[0]["train_samples"] == 2001 and M[0]["val_samples"] == 275, M
    assert close(float(fit_lines(w.stdout, "RESULT")["val_mae"]), M[0]["val_mae"], 1e-4), (w.stdout, M)


def test_curvezmq_keys_given_to_the_strategy(run, tmp_path):
    """psd with CurveZMQ keys: PsdStrategy(key_file=, server_key=) with psd's public key trains;
    with another key as psd's, the worker is refused (authentication failed, a non-zero exit)."""
    for name in ("psd", "worker", "other"):
        subprocess.run([os.environ.get("PSD_BIN", "psd"), "keygen", str(tmp_path / name)], check=True,
                       capture_output=True)
    (tmp_path / "allow").mkdir()
    shutil.copy(tmp_path / "worker.pub", tmp_path / "allow")
    r = run(1, config=CONFIG % 1, extra=("--key", str(tmp_path / "psd.key"), "--allow", str(tmp_path / "allow")))
    key = ("--key-file", str(tmp_path / "worker.key"))
    bad = lit(r, 0, *key, "--server-key", str(tmp_path / "other.pub"))
    o, e = bad.communicate(timeout=120)
    assert bad.returncode != 0 and "authentication failed" in e, e
    good = lit(r, 1, *key, "--server-key", str(tmp_path / "psd.pub"))
    o, e = good.communicate(timeout=120)
    assert good.returncode == 0 and r.psd.wait(timeout=60) == 0, e + r.psd_log()
    assert "authentication: CURVE" in r.psd_log() and result(o)["exit_code"] == 0
