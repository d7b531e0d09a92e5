"""--resume across the change of a user's model's defaults to PyTorch's, and of a run whose
optimizer its first worker offered (docs/config.md, "Runs made before these defaults")."""
import subprocess

from conftest import CONFIG, PSD, Run, safetensors

# what psd ran for CONFIG before a user's model took PyTorch's defaults: its own tuned ones
BEFORE = CONFIG.replace("optimizer: {name: sgd, lr: 0.1, momentum: 0.9}",
                        "optimizer: {name: sgd, lr: 0.1, momentum: 0.9, nesterov: true, weight_decay: 0.0005}")
FLAGS = ["--set", "optimizer.nesterov=true", "--set", "optimizer.weight_decay=0.0005"]


def _train(r, *args, **kw):
    """A worker of run r (its script and arguments), both to a clean end."""
    p = r.worker(*args, **kw)
    o, e = p.communicate(timeout=120)
    assert p.returncode == 0 and r.psd.wait(timeout=60) == 0, e + r.psd_log()
    return o, e


def _without_stop(r):
    """r's psd started again runs to the end (its --stop-after-epoch dropped)."""
    i = r.args.index("--stop-after-epoch")
    del r.args[i:i + 2]


def test_a_run_from_before_the_defaults_is_told_the_flags_and_resumes_with_them(tmp_path):
    """A checkpoint with psd's former defaults (their hash is the values', written out here as a
    run before the change had them): --resume with today's defaults is refused (exit 2) naming
    the flags; with those flags it resumes, and the run ends with the tensors of the same run
    made straight through."""
    assert BEFORE != CONFIG
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    straight = Run(a, 1, config=BEFORE, extra=("--save", str(a / "w.safetensors")))
    try:
        _train(straight)
    finally:
        straight.kill()
    ck = ("--set", "checkpoint.dir=%s" % (b / "ck"))
    r = Run(b, 1, config=BEFORE, extra=("--save", str(b / "w.safetensors")) + ck + ("--stop-after-epoch", "1"))
    try:
        _train(r)
        (b / "now.yaml").write_text(CONFIG)  # today: the same file, without the former defaults
        now = [PSD, "--config", str(b / "now.yaml"), "--listen", "tcp://127.0.0.1:0", "--save", "",
               "--set", "checkpoint.dir=%s" % (b / "ck"), "--resume", str(b / "ck"), "--check-config"]
        c = subprocess.run(now, capture_output=True, text=True, timeout=60)
        assert c.returncode == 2, c.stdout + c.stderr
        assert "written before psd gave a user's model PyTorch's optimizer defaults" in c.stderr, c.stderr
        assert " ".join(FLAGS) in c.stderr, c.stderr
        c = subprocess.run(now + FLAGS, capture_output=True, text=True, timeout=60)
        assert c.returncode == 0 and "would resume run" in c.stdout, c.stdout + c.stderr
        r.args[r.args.index("--config") + 1] = str(b / "now.yaml")
        _without_stop(r)
        r.start_psd("--resume", str(b / "ck"), *FLAGS)
        _train(r)
        assert "resuming run" in r.psd_log()
    finally:
        r.kill()
    assert safetensors(a / "w.safetensors") == safetensors(b / "w.safetensors")


def test_the_offered_optimizer_is_the_checkpoints_and_a_resume_goes_on_with_it(tmp_path):
    """A run whose worker offered Adam with a OneCycleLR (momentum cycled, per step), stopped
    after epoch 4 and resumed: psd takes the optimizer from the checkpoint before any worker
    comes (logged as the worker's, shown by /status), and the run ends with the tensors of the
    same run made straight through."""
    import json
    import time
    import urllib.request

    from conftest import free_port
    from test_optim_replay import CONFIG as RCONFIG

    case = "onecycle_adam"
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    straight = Run(a, 1, config=RCONFIG, extra=("--save", str(a / "w.safetensors")))
    try:
        _train(straight, case, str(a), script="replay_worker.py")
    finally:
        straight.kill()
    port = free_port()
    ck = ("--set", "checkpoint.dir=%s" % (b / "ck"), "--http", "127.0.0.1:%d" % port)
    r = Run(b, 1, config=RCONFIG, extra=("--save", str(b / "w.safetensors")) + ck + ("--stop-after-epoch", "4"))
    try:
        _train(r, case, str(b), script="replay_worker.py")
        _without_stop(r)
        r.start_psd("--resume", str(b / "ck"))
        r.wait_log("listening on")
        log = r.psd_log()
        assert "optimizer.name: adam (worker)" in log and "schedule.torch: \"OneCycleLR(" in log, log
        st = None
        for _ in range(100):
            try:
                st = json.load(urllib.request.urlopen("http://127.0.0.1:%d/status" % port, timeout=5))
                break
            except OSError:
                time.sleep(0.1)
        assert st is not None, r.psd_log()
        assert st["optimizer"]["optimizer.name"] == {"value": "adam", "from": "worker"}, st["optimizer"]
        assert st["optimizer"]["schedule.interval"] == {"value": "step", "from": "worker"}, st["optimizer"]
        assert st["optimizer"]["optimizer.clip_norm"]["from"] == "default", st["optimizer"]
        _train(r, case, str(b), script="replay_worker.py")
        assert "resuming run" in r.psd_log()
    finally:
        r.kill()
    assert safetensors(a / "w.safetensors") == safetensors(b / "w.safetensors")
