"""The figures psd's log and psd.torch give about a run are the run's: the
epochs it trained, the model's tensors and parameters, the workers
(gru_worker.py: a GRU whose 8 tensors psd lays out in 3 units)."""
import re

from conftest import CONFIG  # the run fixture: conftest.py

# gru_worker.py's model: its tensors and their floats (the units psd packs them into differ)
TENSORS, PARAMS = 8, 105 + 147 + 21 + 21 + 70000 + 10000 + 30000 + 3


def finish(r, workers):
    out = [p.communicate(timeout=120) for p in workers]
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    for p, (o, e) in zip(workers, out):
        assert p.returncode == 0, o + e
    return out


def test_run_finished_says_the_epochs_trained_when_stopped_early(run):
    """Early stopping after epoch 2 of 4 (no epoch improves val_loss by 1000): the last line says 2 of 4."""
    config = CONFIG.replace("run: {epochs: 3}", "run: {epochs: 4}").replace(
        "train: {batch_size: 32}",
        "train: {batch_size: 32, early_stop: {metric: val_loss, patience: 1, min_delta: 1000}}")
    r = run(1, config=config)
    finish(r, [r.worker(script="gru_worker.py")])
    log = r.psd_log()
    assert "stopping early after epoch 2" in log, log
    assert "run finished: 2 of 4 epochs (early stop), " in log, log
    L = r.metrics()
    assert [x["epoch"] for x in L] == [1, 2] and L[-1].get("stopped_early") is True, L


def test_run_finished_says_the_epochs_configured_when_all_trained(run):
    r = run(1, config=CONFIG.replace("run: {epochs: 3}", "run: {epochs: 2}"))
    finish(r, [r.worker(script="gru_worker.py")])
    log = r.psd_log()
    assert "run finished: 2 epochs, " in log, log
    assert "early stop" not in log, log


def test_the_offered_model_is_counted_in_tensors_and_parameters(run):
    """from_worker: both lines count the model's tensors and its floats (not psd's units, nor the gaps
    between them)."""
    r = run(1, config=CONFIG.replace("run: {epochs: 3}", "run: {epochs: 1}"))
    [(_, err)] = finish(r, [r.worker(script="gru_worker.py")])
    assert "sending its %d tensors (%d parameters)" % (TENSORS, PARAMS) in err, err
    log = r.psd_log()
    offers = re.findall(r"offers the model: (\d+) tensors, (\d+) parameters", log)
    taken = re.findall(r"the model is the first worker's: (\d+) tensors, (\d+) parameters", log)
    assert offers == [(str(TENSORS), str(PARAMS))], log
    assert taken == [(str(TENSORS), str(PARAMS))], log


def test_world_is_the_runs_once_the_worker_is_constructed(run):
    """w.world right after Worker() returns is psd's workers (2), not 1 until the first epoch."""
    r = run(2, config=CONFIG.replace("run: {epochs: 3}", "run: {epochs: 1}"))
    said = [o for o, _ in finish(r, [r.worker(script="gru_worker.py"), r.worker(script="gru_worker.py")])]
    for o in said:
        assert o.splitlines()[0] == "world 2", said
        assert "epoch 0 done (world 2)" in o, said


def test_a_run_stopped_early_and_resumed_trains_nothing_more(run, tmp_path):
    """The checkpoint of a run that stopped early (after epoch 2 of 4) resumed: psd says so and
    ends at once (exit 0), its metrics file keeps epochs 1-2 only; it used to train epoch 3 on."""
    config = CONFIG.replace("run: {epochs: 3}", "run: {epochs: 4}").replace(
        "train: {batch_size: 32}",
        "train: {batch_size: 32, early_stop: {metric: val_loss, patience: 1, min_delta: 1000}}")
    ck = tmp_path / "ck"
    r = run(1, config=config, extra=("--set", "checkpoint.dir=%s" % ck))
    finish(r, [r.worker(script="gru_worker.py")])
    assert [x["epoch"] for x in r.metrics()] == [1, 2]
    r.start_psd("--resume", str(ck))
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    log = r.psd_log()
    assert "the checkpoint is of a run that stopped early after epoch 2 (train.early_stop): nothing to train" in log, log
    assert [x["epoch"] for x in r.metrics()] == [1, 2], r.metrics()
