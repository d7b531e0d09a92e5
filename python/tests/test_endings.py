"""How a torch worker's run ends (docs/usage.md "How a worker's run ends"): done, left, failed,
lost, refused, or ended by psd with its code. Each: the worker's exit code (a one-line message,
no traceback, where psd ended it), psd's log line with rank, host and reason, and the metrics
file's and /status' counts. Real psd and worker scripts on loopback (conftest.py)."""
import json
import signal
import subprocess
import time
import urllib.request

import conftest
from conftest import free_port, safetensors  # the run fixture: conftest.py

SGD = ("--set", "optimizer.momentum=0", "--set", "optimizer.nesterov=false", "--set", "run.epochs=2")


def one_line(err):
    """stderr of a worker psd ended: no traceback, its last line the message (the lines before
    are the library's log lines)."""
    lines = [x for x in err.splitlines() if x.strip()]
    assert "Traceback" not in err and lines and " psd " not in lines[-1][:30], err
    return lines[-1]


def last_line(log):
    return [x for x in log.splitlines() if x.strip()][-1]


def test_done_every_worker_exits_0_and_nothing_is_counted(run):
    r = run(2, extra=("--set", "run.epochs=1"))
    w = [r.worker(), r.worker()]
    out = [p.communicate(timeout=120) for p in w]
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    assert [p.returncode for p in w] == [0, 0], out
    assert any("exit_code 0" in o for o, e in out), out  # rank 0's w.log: w.exit_code, psd's code, 0
    m = r.metrics()[-1]
    assert (m["workers_left"], m["workers_failed"], m["workers_lost"], m["workers_refused"]) == (0, 0, 0, 0), m
    assert "run finished" in last_line(r.psd_log()) or "step interval" in last_line(r.psd_log()), r.psd_log()


def test_rows_of_reads_more_rows_a_batch_than_the_click_through_task(run, tmp_path):
    """An EmbeddingBag(sparse=True) with bags of 20 rows a sample and rows_of: a batch of 32 asks
    for up to 640 rows, more than the click-through task's 32 x ctr.fields 8 x ctr.per_field 1
    that psd used to apply to any model (every push dropped, the worker lost and registering
    again, forever). Now it trains, bit for bit as without rows_of."""
    got = {}
    for mode in ("rows_of", "whole_replies"):
        d = tmp_path / mode
        d.mkdir()
        r = run(1, extra=SGD + ("--save", str(d / "w.safetensors")))
        p = r.worker("--per-field", "5", *(("--rows-of",) if mode == "rows_of" else ()), script="emb_worker.py")
        o, e = p.communicate(timeout=120)
        assert p.returncode == 0 and r.psd.wait(timeout=60) == 0, e + r.psd_log()
        log = r.psd_log()
        assert " refused: " not in log and "dropped a message" not in log and " lost: " not in log, log
        got[mode] = safetensors(d / "w.safetensors")
        r.kill()
    assert got["rows_of"] == got["whole_replies"]


def test_a_push_psd_cannot_take_ends_that_workers_run_at_once_with_exit_2(run):
    """A worker whose push psd cannot take (here w.step(batch=1000) with a batch size of 32) is
    refused: psd logs why and the run goes on with the other; the worker raises at once and
    exits 2 with psd's reason in one line."""
    r = run(2)
    bad, good = r.worker("--batch-figure", "1000"), r.worker()
    o, e = bad.communicate(timeout=60)
    assert bad.returncode == 2, (o, e, r.psd_log())
    line = one_line(e)
    assert "psd refused this worker" in line and "PUSH of a batch of 1000 (train.batch_size 32" in line, line
    good.communicate(timeout=120)
    assert r.psd.wait(timeout=60) == 0 and good.returncode == 0, r.psd_log()
    log = r.psd_log()
    assert "refused: PUSH of a batch of 1000" in log and "its run ends (exit 2)" in log, log
    assert " lost: " not in log and "registers again" not in log, log
    m = r.metrics()[-1]
    assert m["workers_refused"] == 1 and m["workers_lost"] == 0 and m["train_samples"] == 1800, m
    assert "finished with 1 of the 2 workers it started with" in last_line(log) and "1 refused" in last_line(log), log


def test_a_worker_whose_loop_raises_is_failed_not_lost(run):
    """An exception in the user's loop: psd hears the failure (its type, message and line) and
    counts it apart from losses; the worker's traceback is Python's own, exit 1; the run ends 0
    and its last log line says it finished with fewer workers."""
    http = "127.0.0.1:%d" % free_port()
    r = run(2, extra=("--http", http, "--set", "run.epochs=2"))
    bad, good = r.worker("--raise-at", "5", "--slow", "0.01"), r.worker("--slow", "0.01")
    o, e = bad.communicate(timeout=60)
    assert bad.returncode == 1 and "Traceback" in e and "ValueError: a bug in the user's loop" in e, e
    r.wait_log("failed: ValueError: a bug in the user's loop at step 5 (mlp_worker.py:")
    st = json.loads(urllib.request.urlopen("http://%s/status" % http, timeout=10).read())
    assert st["workers_failed"] == 1 and st["workers_lost"] == 0, st
    assert [x.get("ended") for x in st["workers"] if x["state"] == "gone"] == ["failed"], st["workers"]
    good.communicate(timeout=120)
    assert r.psd.wait(timeout=60) == 0 and good.returncode == 0, r.psd_log()
    log = r.psd_log()
    assert " lost: " not in log, log
    m = r.metrics()[-1]
    assert (m["workers_failed"], m["workers_lost"]) == (1, 0) and m["train_samples"] == 1800, m
    last = last_line(log)
    assert "finished with 1 of the 2 workers it started with: 1 failed, 0 lost" in last, log
    assert "a step now averages the batches of 1 worker (1 x train.batch_size 32 = 32 samples), 2 before" in log, log
    assert log.count("a step now averages") == 1, log


def test_left_on_sigterm_or_when_the_script_ends_lost_when_killed(run):
    """SIGTERM: the worker leaves (exit 0), psd logs why; a script that returns while still in
    the run leaves too; SIGKILL: lost. Each counted as such."""
    r = run(4, extra=("--set", "run.epochs=2"))
    w = [r.worker("--slow", "0.03") for _ in range(3)] + [r.worker("--exit-at", "8", "--slow", "0.03")]
    r.wait_log("training 2 epochs")
    time.sleep(0.5)
    w[0].send_signal(signal.SIGTERM)
    w[1].kill()
    out = [p.communicate(timeout=120) for p in w]
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    assert [p.returncode for p in w] == [0, -signal.SIGKILL, 0, 0], out
    assert "Traceback" not in out[0][1] + out[3][1], out
    log = r.psd_log()
    assert "left the run: SIGTERM" in log and "left the run: its script ended before the run did" in log, log
    assert "lost: its connection closed" in log, log
    m = r.metrics()[-1]
    assert (m["workers_left"], m["workers_lost"], m["workers_failed"]) == (2, 1, 0), m
    assert m["train_samples"] == 1800, m


def test_psd_ending_the_run_is_the_workers_exit_code_in_one_line(run):
    """psd's start timeout (exit 3): the torch worker that came exits 3 with psd's reason, no
    traceback; a worker with other data is refused at once: exit 2."""
    r = run(2, extra=("--start-timeout", "3"))
    p = r.worker()
    o, e = p.communicate(timeout=60)
    assert r.psd.wait(timeout=60) == 3, r.psd_log()
    assert p.returncode == 3, (o, e)
    assert "not all workers came in time" in one_line(e), e
    r2 = run(2)
    a = r2.worker("--data-id", "v1")
    r2.wait_log("the run's data is rank")
    b = r2.worker("--data-id", "v2")
    o, e = b.communicate(timeout=60)
    assert b.returncode == 2 and "'v2'" in one_line(e), e
    assert " refused: " in r2.psd_log(), r2.psd_log()


def test_psd_lost_and_not_back_within_retry_s_is_exit_4_in_one_line(run):
    """psd killed (-9) mid-run and not restarted: the torch worker registers again for retry_s,
    then exits 4 with one line naming psd's endpoint, no traceback."""
    r = run(1)
    p = r.worker("--slow", "0.02", "--retry-s", "2")
    r.wait_log("workers ready; training")
    time.sleep(0.5)
    r.psd.kill()
    r.psd.wait()
    o, e = p.communicate(timeout=60)
    assert p.returncode == 4, (o, e)
    line = one_line(e)
    assert "did not come back within 2 s" in line and r.ep in line, e
    assert "registering again for up to 2 s" in e, e


def test_a_psd_shard_lost_is_the_workers_exit_5_in_one_line(run, tmp_path):
    """psd with two shards: shard 1 killed mid-run, psd (shard 0) ends the run with exit 5 and
    the torch worker exits 5 with psd's reason in one line."""
    r = run(1, extra=("--shard", "0/2", "--worker-timeout", "2"))
    shard = subprocess.Popen([conftest.PSD, "--config", str(tmp_path / "c.yaml"), "--shard", "1/2", "--leader", r.ep,
                              "--listen", "tcp://127.0.0.1:%d" % free_port(), "--set", "checkpoint.dir=",
                              "--worker-timeout", "2"], stdout=r.log, stderr=subprocess.STDOUT)
    r.procs.append(shard)
    p = r.worker("--slow", "0.02", "--hidden", "1100")  # 23,104 parameters: 2 blocks, one a shard
    r.wait_log("workers ready; training")
    time.sleep(0.5)
    shard.kill()
    shard.wait()
    assert r.psd.wait(timeout=60) == 5, r.psd_log()
    o, e = p.communicate(timeout=60)
    assert p.returncode == 5, (o, e)
    assert "psd ended this worker's run (exit 5)" in one_line(e), e
