"""psd.torch end to end: a real psd (PSD_BIN) and torch workers
(mlp_worker.py, each its own process) on loopback, free ports, every
process ended by its PID."""
import ctypes
import json
import os
import shutil
import signal
import subprocess
import time

from psd import _lib

from conftest import HERE, PSD, Run, free_port, safetensors  # the run fixture: conftest.py


def test_the_binding_matches_the_library():
    lib = _lib.load()
    for name, cls in _lib._STRUCTS.items():
        assert lib.psw_struct_size(name.encode()) == ctypes.sizeof(cls), name
    assert lib.psw_struct_size(b"no_such_t") == 0


def test_two_torch_workers_train_with_exact_counts(run):
    r = run(2)
    w = [r.worker(), r.worker()]
    out = [p.communicate(timeout=120) for p in w]
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    for p, (o, e) in zip(w, out):
        assert p.returncode == 0, o + e
    L = r.metrics()
    assert len(L) == 3
    for x in L:
        assert x["train_samples"] == 1800 and x["val_samples"] == 200 and x["val_set"] == "held_out", x
        assert "val_abs_err" in x
    assert L[-1]["test_samples"] == 500 and L[-1]["test_acc"] >= 0.85, L[-1]
    # rank 0 logs, rank 1 prints nothing at INFO; the model keeps its own attributes and methods
    said = [o for o, _ in out]
    chief = [o for o in said if "rank 0 epoch 2 done" in o]
    assert len(chief) == 1 and "model intact: Net(mine)" in chief[0], said
    quiet = [o for o in said if o is not chief[0]][0]
    assert quiet == "", quiet


def test_a_worker_with_other_data_is_refused(run):
    r = run(2)
    a = r.worker("--data-id", "v1")
    r.wait_log("the run's data is rank")
    b = r.worker("--data-id", "v2")
    r.wait_log("refused")  # psd waits for a second worker with its data
    c = r.worker("--data-id", "v1")
    outs = {p: p.communicate(timeout=120) for p in (a, b, c)}
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    assert a.returncode == 0 and c.returncode == 0 and b.returncode != 0, [(p.returncode, outs[p]) for p in (a, b, c)]
    err = outs[b][1]
    assert "'v1'" in err and "'v2'" in err, err


def test_a_foreign_optimizer_step_is_refused(run):
    r = run(1)
    p = r.worker("--optimizer")
    o, e = p.communicate(timeout=120)
    assert p.returncode != 0
    assert "changed in place" in e and "optimizer" in e, e


def test_quickstart_torch_runs_as_written():
    """The README's `sh deploy/quickstart.sh torch`, for one epoch of 3,000 samples on a free port."""
    root = os.path.normpath(os.path.join(HERE, "..", ".."))
    env = dict(os.environ, PSD_PORT=str(free_port()))
    p = subprocess.run(["sh", "deploy/quickstart.sh", "torch", "--epochs", "1", "--set", "data.train_limit=3000",
                        "--metrics", "quickstart-torch.jsonl"], cwd=root, env=env, capture_output=True, text=True,
                       timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    path = os.path.join(root, "run", "quickstart-torch.jsonl")
    L = [json.loads(x) for x in open(path)]
    os.unlink(path)
    assert len(L) == 1 and L[0]["train_samples"] == 2700 and L[0]["val_samples"] == 300, L
    assert L[0]["test_samples"] == 10000 and L[0]["best_epoch"] == 1, L


def test_sigterm_leaves_and_kill9_costs_only_samples(run):
    """3 torch workers, 50 ms a step (about 1 s an epoch): one is sent SIGTERM (it leaves:
    exit 0), one is killed with SIGKILL, mid-epoch; the third trains the run to its end,
    every sample once an epoch."""
    r = run(3, extra=("--set", "run.epochs=2"))
    w = [r.worker("--slow", "0.05") for _ in range(3)]
    r.wait_log("training 2 epochs")
    time.sleep(0.3)
    w[0].send_signal(signal.SIGTERM)
    w[1].send_signal(signal.SIGKILL)
    out = [p.communicate(timeout=120) for p in w]
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    assert w[0].returncode == 0, out[0]
    assert w[1].returncode == -signal.SIGKILL
    assert w[2].returncode == 0, out[2]
    assert "left the run" in r.psd_log()
    L = r.metrics()
    assert len(L) == 2 and all(x["train_samples"] == 1800 and x["val_samples"] == 200 for x in L), L
    assert L[-1]["test_samples"] == 500


def test_psd_killed_and_resumed_torch_workers_carry_on(run, tmp_path):
    """psd is killed with SIGKILL in the middle of epoch 2 and started again with --resume:
    the 2 running torch workers register again by themselves and the run ends with every
    epoch's counts exact."""
    r = run(2, extra=("--set", "checkpoint.dir=%s" % (tmp_path / "ck"), "--set", "checkpoint.every_steps=10"))
    w = [r.worker("--slow", "0.04"), r.worker("--slow", "0.04")]
    r.wait_log("epoch 1/3 step")
    time.sleep(0.6)
    r.psd.kill()
    r.psd.wait()
    r.start_psd("--resume", str(tmp_path / "ck"))
    out = [p.communicate(timeout=180) for p in w]
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    for p, (o, e) in zip(w, out):
        assert p.returncode == 0, o + e
        assert "registered again" in e, e
    assert "resuming run" in r.psd_log()
    L = r.metrics()
    assert [x["epoch"] for x in L] == [1, 2, 3], L
    for x in L:
        assert x["train_samples"] == 1800 and x["val_samples"] == 200, x
    assert L[-1]["test_samples"] == 500 and L[-1]["test_acc"] >= 0.85, L[-1]


def test_stopped_and_resumed_at_an_epoch_boundary_gives_the_same_tensors(run, tmp_path):
    """One torch worker, one thread: 3 epochs straight, against 1 epoch, --stop-after-epoch,
    --resume and a new worker process for the other 2: the saved tensors are bit for bit the
    same. The second run's worker drops its gradients (zero_grad(set_to_none=True)) each batch
    and the first's never zeroes them: psd zeroes them before each batch either way."""
    a = tmp_path / "a"
    b = tmp_path / "b"
    a.mkdir()
    b.mkdir()
    r1 = run(1, extra=("--save", str(a / "w.safetensors")))
    p = r1.worker()
    o, e = p.communicate(timeout=120)
    assert p.returncode == 0 and r1.psd.wait(timeout=60) == 0, e + r1.psd_log()
    assert "copies 0 " in o, o  # the gradients were computed in psd's shared memory
    ck = ("--set", "checkpoint.dir=%s" % (b / "ck"))
    r2 = Run(b, 1, extra=("--save", str(b / "w.safetensors")) + ck + ("--stop-after-epoch", "1"))
    try:
        p = r2.worker("--set-to-none")
        o, e = p.communicate(timeout=120)
        assert p.returncode == 0 and r2.psd.wait(timeout=60) == 0, e + r2.psd_log()
        assert "stopping after epoch 1" in r2.psd_log()
        r2.start_psd("--resume", str(b / "ck"))
        p = r2.worker("--set-to-none")
        o, e = p.communicate(timeout=120)
        assert p.returncode == 0 and r2.psd.wait(timeout=60) == 0, e + r2.psd_log()
        assert "copies 0 " not in o and "the gradients are not in psd's shared memory" in e, o + e
    finally:
        r2.kill()
    ta, tb = safetensors(a / "w.safetensors"), safetensors(b / "w.safetensors")
    assert sorted(ta) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert ta == tb


def test_a_dataloader_trains_every_sample_once_as_psd_moves_them(run, tmp_path):
    """3 torch workers reading through DataLoader(batch_sampler=w.sampler(), num_workers=2),
    async with rebalancing, rank 0 slowed down: psd moves its samples to the others while
    their loaders read ahead. Each epoch every training sample is stepped exactly once (the
    workers' own lists of what they stepped), and no held-out one."""
    r = run(3, extra=("--set", "train.sync=async", "--set", "run.epochs=2"))
    files = [tmp_path / ("ids%d" % i) for i in range(3)]
    w = [r.worker("--loader", "2", "--ids", str(files[0]), "--slow", "0.03")]
    r.wait_log("the run's data is rank")
    w += [r.worker("--loader", "2", "--ids", str(f)) for f in files[1:]]
    out = [p.communicate(timeout=180) for p in w]
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    for p, (o, e) in zip(w, out):
        assert p.returncode == 0, o + e
    assert "samples moved from slower workers" in r.psd_log(), r.psd_log()
    dropped = int(out[0][0].split(" dropped ")[1].split()[0])  # rank 0's loader had read past what it kept
    assert dropped > 0, out[0]
    by = [r.ids(f, 2) for f in files]
    for e in range(2):
        stepped = sorted(i for k in range(3) for i in by[k][e])
        assert len(stepped) == 1800 and len(set(stepped)) == 1800, (e, len(stepped), len(set(stepped)))
    L = r.metrics()
    assert all(x["train_samples"] == 1800 for x in L) and L[-1]["test_samples"] == 500, L


def test_a_dataloader_worker_killed_mid_epoch(run, tmp_path):
    """3 DataLoader torch workers, one killed with SIGKILL mid-epoch: the two left train its
    samples (a second pass over their loaders), none of them twice, and psd's counts are exact."""
    r = run(3, extra=("--set", "run.epochs=2"))
    files = [tmp_path / ("ids%d" % i) for i in range(3)]
    w = [r.worker("--loader", "1", "--ids", str(f), "--slow", "0.03") for f in files]
    r.wait_log("training 2 epochs")
    time.sleep(0.5)
    w[2].kill()
    out = [p.communicate(timeout=180) for p in w]
    assert r.psd.wait(timeout=60) == 0, r.psd_log()
    assert w[2].returncode == -signal.SIGKILL and "rank 2" in r.psd_log()
    assert w[0].returncode == 0 and w[1].returncode == 0, out
    by = [r.ids(f, 2) for f in files[:2]]
    for e in range(2):
        stepped = [i for k in range(2) for i in by[k][e]]
        assert len(stepped) == len(set(stepped)), e
    assert len(by[0][1]) + len(by[1][1]) == 1800
    L = r.metrics()
    assert len(L) == 2 and all(x["train_samples"] == 1800 and x["val_samples"] == 200 for x in L), L


def test_the_device_path_on_cpu_tensors_gives_the_same_tensors(run, tmp_path):
    """The staging of device parameters (host buffers laid out as psd's model, a hook a
    parameter, weights loaded through a second buffer), run on CPU tensors with the copies
    made synchronously, and with each layer pushed during backward (w.backward): one worker,
    2 epochs, bit for bit the tensors of the plain CPU path."""
    got = {}
    for mode, flags in (("plain", ()), ("staged", ("--staging",)), ("early", ("--staging", "--early"))):
        d = tmp_path / mode
        d.mkdir()
        r = run(1, extra=("--set", "run.epochs=2", "--save", str(d / "w.safetensors")))
        p = r.worker(*flags)
        o, e = p.communicate(timeout=120)
        assert p.returncode == 0 and r.psd.wait(timeout=60) == 0, e + r.psd_log()
        got[mode] = safetensors(d / "w.safetensors")
        r.kill()
        steps = int(o.split(" steps ")[1].split()[0])
        layers = int(o.split(" layer_pushes ")[1].split()[0])
        # backward gives fc2's two tensors, then fc1's: all but the newest go before step()
        assert layers == (3 * steps if mode == "early" else 0), o
    assert got["staged"] == got["plain"]
    assert got["early"] == got["plain"]


def test_bfloat16_on_the_wire_rounded_by_the_worker_gives_the_librarys_tensors(run, tmp_path):
    """train.wire_gradients and train.wire_weights bf16, one worker over the wire: the device
    path (run on CPU tensors) rounds each gradient to bfloat16 itself and sends half the bytes
    from a bfloat16 host buffer, and widens psd's bfloat16 weights itself; with each layer
    pushed during backward as well. 2 epochs: bit for bit the tensors of the plain path, where
    the worker library rounds and widens."""
    got, pushed = {}, {}
    for mode, flags in (("plain", ()), ("staged", ("--staging",)), ("early", ("--staging", "--early"))):
        d = tmp_path / mode
        d.mkdir()
        r = run(1, extra=("--set", "run.epochs=2", "--set", "train.wire_gradients=bf16",
                          "--set", "train.wire_weights=bf16", "--save", str(d / "w.safetensors")))
        p = r.worker("--no-shm", *flags)
        o, e = p.communicate(timeout=120)
        assert p.returncode == 0 and r.psd.wait(timeout=60) == 0, e + r.psd_log()
        got[mode] = safetensors(d / "w.safetensors")
        pushed[mode] = int(o.split(" bytes_pushed ")[1].split()[0])
        r.kill()
    assert got["staged"] == got["plain"]
    assert got["early"] == got["plain"]
    assert pushed["staged"] * 2 == pushed["plain"] and pushed["early"] == pushed["staged"], pushed


def test_autocast_in_the_users_loop_trains_with_float32_parameters(run, tmp_path):
    """The forward under torch.autocast(bfloat16), as a mixed-precision loop has it, on the
    plain and the device path: the parameters and their gradients stay float32 (psd's master
    weights are), the run trains (the loss falls) and ends as close to the float32 run as
    bfloat16's rounding of the forward allows."""
    figs = {}
    for mode, flags in (("f32", ()), ("autocast", ("--autocast",)), ("staged", ("--autocast", "--staging"))):
        r = run(1, extra=("--set", "run.epochs=2"))
        p = r.worker(*flags)
        o, e = p.communicate(timeout=120)
        assert p.returncode == 0 and r.psd.wait(timeout=60) == 0, e + r.psd_log()
        if mode != "f32":
            assert "autocast: parameters ['torch.float32'], gradients ['torch.float32']" in o + e, o + e
        L = r.metrics()[-2:]
        figs[mode] = [(x["train_loss"], x["val_acc"]) for x in L]
        r.kill()
    for mode in ("autocast", "staged"):
        (l1, _), (l2, acc) = figs[mode]
        assert l2 < l1, figs
        assert abs(acc - figs["f32"][1][1]) <= 0.05, figs


def test_three_workers_on_the_wire_announce_their_pushes_and_give_the_same_tensors(run, tmp_path):
    """3 psd.torch workers over the wire (no shared memory), more than psd's server.grad_room of
    2: all but rank 0 announce their pushes and send them when psd asks, psd sums them in rank
    order as they come; with each layer pushed during backward (w.backward) as well: 2 epochs, bit
    for bit the tensors of a psd that holds every push until the step (grad_room 0), every sample
    trained once."""
    got = {}
    for mode, room, flags in (("held", "0", ()), ("summed", "2", ()), ("layers", "2", ("--staging", "--early"))):
        d = tmp_path / mode
        d.mkdir()
        r = run(3, extra=("--set", "run.epochs=2", "--set", "server.grad_room=" + room,
                          "--save", str(d / "w.safetensors")))
        ps = [r.worker("--no-shm", *flags) for _ in range(3)]
        for p in ps:
            o, e = p.communicate(timeout=180)
            assert p.returncode == 0, e[-3000:]
        assert r.psd.wait(timeout=60) == 0, r.psd_log()
        L = r.metrics()[-2:]  # (one metrics file for the test's runs)
        assert [x["epoch"] for x in L] == [1, 2] and all(x["train_samples"] == 1800 and x["wire_bytes_in"] > 0
                                                          for x in L), \
            [(x["train_samples"], x["wire_bytes_in"]) for x in L]
        got[mode] = safetensors(d / "w.safetensors")
        r.kill()
    assert got["summed"] == got["held"]
    assert got["layers"] == got["held"]


def test_keys_and_endpoint_from_the_environment(run, tmp_path):
    """As the SLURM script starts PSD_WORKER_CMD: PSD_ENDPOINT, PSD_KEY_FILE and PSD_SERVER_KEY
    in the environment; psd with CurveZMQ keys. A worker with psd's key wrong is refused, the
    right one trains."""
    for name in ("psd", "worker", "other"):
        subprocess.run([PSD, "keygen", str(tmp_path / name)], check=True, capture_output=True)
    (tmp_path / "allow").mkdir()
    shutil.copy(tmp_path / "worker.pub", tmp_path / "allow")
    r = run(1, extra=("--set", "run.epochs=1", "--key", str(tmp_path / "psd.key"), "--allow", str(tmp_path / "allow")))
    keys = {"PSD_KEY_FILE": str(tmp_path / "worker.key")}
    bad = r.worker(env=dict(keys, PSD_SERVER_KEY=str(tmp_path / "other.pub")))
    o, e = bad.communicate(timeout=120)
    assert bad.returncode != 0 and "authentication failed" in e, e
    good = r.worker(env=dict(keys, PSD_SERVER_KEY=str(tmp_path / "psd.pub")))
    o, e = good.communicate(timeout=120)
    assert good.returncode == 0 and r.psd.wait(timeout=60) == 0, e + r.psd_log()
    assert "authentication: CURVE" in r.psd_log() and "model intact" in o


def test_the_source_trees_package_finds_the_build_trees_library(tmp_path):
    """README "Finding it": PYTHONPATH=<checkout>/python is enough for a script run from
    anywhere; the package loads <checkout>/build/libpsworker.so.3 (the build quickstart.sh
    makes) without PSD_WORKER_LIB."""
    root = os.path.dirname(os.path.dirname(HERE))
    lib = os.path.join(root, "build", "libpsworker.so.3")
    if not os.path.exists(lib):
        import pytest
        pytest.skip("no build/ in this checkout (built elsewhere): nothing to find")
    env = {k: v for k, v in os.environ.items() if k != "PSD_WORKER_LIB"}
    env["PYTHONPATH"] = os.path.join(root, "python")
    out = subprocess.run(["/usr/bin/python3", "-c", "from psd import _lib; print(_lib.load()._name)"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == lib, out


def test_meson_install_installs_every_module_of_the_package():
    """Each python/psd/*.py is in meson.build's install_data: a module left out is a package
    that imports in the source tree and fails once installed (the Docker image's check)."""
    import re
    root = os.path.dirname(os.path.dirname(HERE))
    text = open(os.path.join(root, "meson.build")).read()
    listed = set(re.findall(r"'python/psd/([A-Za-z0-9_]+\.py)'", text))
    have = {f for f in os.listdir(os.path.join(root, "python", "psd")) if f.endswith(".py")}
    assert have - listed == set(), "not installed by meson.build: %s" % sorted(have - listed)
