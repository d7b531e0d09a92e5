"""What the psd.torch tests share: a real psd (PSD_BIN) and worker scripts (each its own
process) on loopback, free ports, every process ended by its PID."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PSD = os.environ.get("PSD_BIN", "psd")
CONFIG = """model: {kind: from_worker}
run: {epochs: 3}
data: {val_fraction: 0.1}
train: {batch_size: 32}
optimizer: {name: sgd, lr: 0.1, momentum: 0.9}
schedule: {name: constant}
"""


FRAMEWORK_CONFIG = """model: {kind: from_worker}
run: {epochs: %d}
train: {batch_size: 20}
"""


def result(out):
    """The JSON line a framework's test worker (lit_worker.py, ign_worker.py) prints at its end."""
    return json.loads([x for x in out.splitlines() if x.startswith("{")][-1])


def close(a, b, rel=1e-6):
    return abs(a - b) <= rel * max(abs(a), abs(b))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Run:
    """psd and its workers in tmp; kill() ends what is left by PID."""

    def __init__(self, tmp, workers, config=CONFIG, extra=()):
        self.tmp = tmp
        self.ep = "tcp://127.0.0.1:%d" % free_port()
        (tmp / "c.yaml").write_text(config)
        self.log = open(tmp / "psd.log", "w")
        self.args = [PSD, "--config", str(tmp / "c.yaml"), "--workers", str(workers), "--listen", self.ep,
                     "--metrics", str(tmp / "m.jsonl"), "--save", "", "--set", "checkpoint.dir=",
                     "--start-timeout", "30", *extra]
        self.procs = []
        self.start_psd()

    def start_psd(self, *more):
        self.psd = subprocess.Popen(self.args + list(more), stdout=self.log, stderr=subprocess.STDOUT)
        self.procs.append(self.psd)

    def worker(self, *args, script="mlp_worker.py", env=None):
        """A worker script; with env, its endpoint comes from PSD_ENDPOINT (and env's other variables)."""
        argv = [sys.executable, os.path.join(HERE, script)] + ([""] if env else [self.ep]) + list(args)
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, PSD_ENDPOINT=self.ep, **env) if env else None)
        self.procs.append(p)
        return p

    def ids(self, path, epochs):
        """The sample ids a worker's --ids file says it stepped, by epoch."""
        by = [[] for _ in range(epochs)]
        for line in open(path):
            e, ids = json.loads(line)
            by[e].extend(ids)
        return by

    def metrics(self):
        return [json.loads(x) for x in (self.tmp / "m.jsonl").read_text().splitlines()]

    def psd_log(self):
        self.log.flush()
        return (self.tmp / "psd.log").read_text()

    def wait_log(self, text, timeout=30):
        deadline = time.time() + timeout
        while text not in self.psd_log():
            assert time.time() < deadline, "psd did not log %r:\n%s" % (text, self.psd_log())
            time.sleep(0.05)

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.log.close()


@pytest.fixture
def run(tmp_path):
    runs = []

    def make(*a, **kw):
        r = Run(tmp_path, *a, **kw)
        runs.append(r)
        return r

    yield make
    for r in runs:
        r.kill()


def safetensors(path):
    """name -> raw bytes of each tensor of a safetensors file."""
    b = open(path, "rb").read()
    n = int.from_bytes(b[:8], "little")
    head = json.loads(b[8:8 + n])
    return {k: b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
            for k, v in head.items() if k != "__metadata__"}
