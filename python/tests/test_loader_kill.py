"""A torch worker whose DataLoader has reader processes, killed with SIGKILL: psd notices at
once that its connection closed (issue 56). The readers are forked children of the worker;
they must not hold its connection to psd (the library closes it in forked children), or
the kernel keeps it open and psd notices only by silence, --worker-timeout later."""
import datetime
import os
import re
import signal
import time


def stat(pid):
    """Fields of /proc/PID/stat after the command's name (field 4, the parent's PID, first), or None."""
    try:
        return open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()[1:]
    except OSError:
        return None


def children(pid):
    """(PID, start time) of the processes whose parent is pid."""
    out = []
    for d in os.listdir("/proc"):
        st = stat(int(d)) if d.isdigit() else None
        if st and int(st[0]) == pid:
            out.append((int(d), st[18]))
    return out


def logged_at(line):
    """The time (seconds since the epoch) of a psd log line: its UTC timestamp, to the ms."""
    ts = datetime.datetime.strptime(line.split()[0], "%Y-%m-%dT%H:%M:%S.%fZ")
    return ts.replace(tzinfo=datetime.timezone.utc).timestamp()


def test_a_worker_with_dataloader_processes_killed_is_lost_at_once(run, tmp_path):
    """2 torch workers, one reading through a DataLoader with 2 reader processes, killed with
    SIGKILL mid-epoch: psd logs it lost because its connection closed within 1 s of the kill
    (not by its silence, --worker-timeout 5 s later), and the other worker ends the run."""
    r = run(2, extra=("--set", "run.epochs=2"))
    plain = r.worker("--slow", "0.03")
    loader = r.worker("--loader", "2", "--slow", "0.03")
    r.wait_log("training 2 epochs")
    deadline = time.time() + 30
    while len(children(loader.pid)) < 2:  # its readers forked: the epoch's batches are being read
        assert loader.poll() is None and time.time() < deadline, r.psd_log()
        time.sleep(0.05)
    readers = children(loader.pid)
    time.sleep(0.3)
    t_kill = time.time()
    loader.kill()
    try:
        loader.wait(timeout=10)
        lost = re.compile(r"^\S+ .* pid %d\) lost: .*$" % loader.pid, re.M)
        deadline = time.time() + 30
        while not lost.search(r.psd_log()):
            assert time.time() < deadline, r.psd_log()
            time.sleep(0.02)
        line = lost.search(r.psd_log()).group(0)
        delay = logged_at(line) - t_kill
        print("psd declared the killed worker lost %.3f s after the kill: %s" % (delay, line))
        assert "lost: its connection closed" in line and delay < 1.0, (delay, line)
        o, e = plain.communicate(timeout=180)
        assert plain.returncode == 0, o + e
        assert r.psd.wait(timeout=60) == 0, r.psd_log()
        assert loader.returncode == -signal.SIGKILL
    finally:
        for pid, start in readers:  # orphaned: they end by themselves once they see their parent gone
            st = stat(pid)
            if st and st[18] == start:  # still that process
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
