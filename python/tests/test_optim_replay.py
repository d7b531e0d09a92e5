"""The optimizer and scheduler a torch worker offers, run by psd, against plain
PyTorch: psd (model.kind from_worker, nothing about the optimizer in its
config) trains replay_worker.py's 20-32-4 MLP for 500 steps of 8 samples with
the case's optimizer and scheduler (replay_cases.py); the test then replays
the same batches, in the same order, from the same initial weights, with
torch.optim itself (zero_grad, backward, clip_grad_norm_, step, scheduler
step), and compares the weights.

Tolerance: psd's optimizer is float32 as PyTorch's, but the two do not round
alike (fused expressions, the scheduler's closed form against PyTorch's
chained one, the gradient's reduction), and 500 steps of training carry
a difference of a few float32 ulps (6e-8 relative) along: every case here
measured 1.5e-7 to 7e-7 after its 500 steps (torch 1.13, x86-64). 1e-4
leaves that 140 times over, while an lr 1% off moves the weights by 5e-3
(test_a_wrong_replay_is_seen). The model is smooth (tanh): with a ReLU a
pre-activation within rounding of 0 can take either side in the two runs,
and that one unit's step, not rounding, then sets the difference (1e-3 seen).
"""
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import Run, safetensors
from replay_cases import BATCH, EPOCHS, STEPS, TRAIN, Net, build, data

TOL = 1e-4
CONFIG = """model: {kind: from_worker}
run: {epochs: %d}
train: {batch_size: %d}
""" % (EPOCHS, BATCH)
RESULTS = {}
pytestmark = pytest.mark.filterwarnings("ignore:The epoch parameter")  # torch's own SequentialLR


def psd_run(tmp, case, config=CONFIG, extra=()):
    """psd and one replay_worker.py of case: (psd's final weights, the worker's batches by epoch, psd's log)."""
    out = tmp / "out.safetensors"
    r = Run(tmp, 1, config=config, extra=("--save", str(out), *extra))
    try:
        w = r.worker(case, str(tmp), script="replay_worker.py")
        o, e = w.communicate(timeout=120)
        assert w.returncode == 0, o + e + r.psd_log()
        assert r.psd.wait(timeout=60) == 0, r.psd_log()
        log = r.psd_log()
    finally:
        r.kill()
    init = torch.load(tmp / "init.pt")
    raw = safetensors(out)
    final = {k: torch.frombuffer(bytearray(raw[k]), dtype=torch.float32).view(v.shape) for k, v in init.items()}
    by = [[] for _ in range(EPOCHS)]
    for line in open(tmp / "ids.jsonl"):
        e, ids = json.loads(line)
        by[e].append(ids)
    assert sum(len(b) for b in by) == STEPS and all(len(x) == BATCH for b in by for x in b)
    return init, final, by, log


def replay(case, init, by, tweak=None):
    """Plain PyTorch over the same batches: the weights after them (tweak(opt, sched): changed first)."""
    torch.set_num_threads(1)
    model = Net()
    model.load_state_dict(init)
    opt, sched, interval, clip = build(case, model)
    if tweak:
        tweak(opt, sched)
    x, y = data(TRAIN, 1)
    replay.clipped = 0
    for batches in by:
        for idx in batches:
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            if clip is not None:
                replay.clipped += int(torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > clip)
            opt.step()
            if sched is not None and interval == "step":
                sched.step()
        if sched is not None and interval == "epoch":
            sched.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def rel_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a) / max(b[k].abs().max().item() for k in b)


REPLAYED = ["sgd_plain", "sgd_nesterov", "adam", "adamw", "adagrad", "constant", "linear", "onecycle_sgd",
            "onecycle_adam", "sequential", "groups_sgd", "groups_adamw_clip", "clip_sgd", "epoch_step",
            "epoch_cosine", "epoch_sequential"]


@pytest.mark.parametrize("case", REPLAYED)
def test_psd_runs_the_offered_optimizer_as_pytorch(case, tmp_path):
    init, final, by, log = psd_run(tmp_path, case)
    want = replay(case, init, by)
    d = rel_diff(final, want)
    moved = rel_diff(init, want)
    RESULTS[case] = d
    print("replay %-18s max|w_psd - w_torch| / max|w_torch| = %.3g (the weights moved %.3g)" % (case, d, moved))
    assert moved > 0.05  # the case trains: a difference is not lost in weights that stay put
    if build(case, Net())[3] is not None:
        print("replay %-18s clipped %d steps of %d" % (case, replay.clipped, STEPS))
        assert replay.clipped > STEPS // 4  # clip_norm matters
    assert d < TOL, "%s: %.3g\n%s" % (case, d, log[-3000:])


def test_the_replay_of_psds_own_config(tmp_path):
    """The control: no offer, psd's config says Adam; the replay matches (else the harness is wrong,
    not the offer)."""
    cfg = CONFIG + "optimizer: {name: adam, lr: 0.002, weight_decay: 0.0001}\nschedule: {name: constant}\n"
    init, final, by, _ = psd_run(tmp_path, "nothing", config=cfg)
    d = rel_diff(final, replay("nothing_replay", init, by))
    RESULTS["control (config)"] = d
    print("replay control (psd's config, no offer): %.3g" % d)
    assert d < TOL


def test_a_wrong_replay_is_seen(tmp_path):
    """The comparison sees a wrong hyper-parameter: psd's Adam run replayed with an lr 1% off."""
    init, final, by, _ = psd_run(tmp_path, "adam")

    def off(opt, sched):
        for g in opt.param_groups:
            g["lr"] *= 1.01
        sched.base_lrs = [b * 1.01 for b in sched.base_lrs]
    d = rel_diff(final, replay("adam", init, by, tweak=off))
    print("replay adam with lr 1%% off: %.3g" % d)
    assert d > 10 * TOL


def test_config_beats_the_offer_and_the_offer_beats_the_default(tmp_path):
    """psd's --set optimizer.lr=0.05 while the worker offers SGD lr 0.01, weight_decay 0.1,
    momentum 0.5: psd runs lr 0.05 (config), weight_decay 0.1 and momentum 0.5 (the worker's,
    not psd's defaults 5e-4 and 0.9), nesterov false (the worker's; psd's default is true)."""
    init, final, by, log = psd_run(tmp_path, "precedence", extra=("--set", "optimizer.lr=0.05"))
    took = {k: (v, src) for k, v, src in
            re.findall(r"psd INFO  optimizer\.(\w+): (\S+) \((config|worker|default)\)", log)}
    assert float(took["lr"][0]) == 0.05 and took["lr"][1] == "config", log
    assert float(took["weight_decay"][0]) == 0.1 and took["weight_decay"][1] == "worker", log
    assert float(took["momentum"][0]) == 0.5 and took["momentum"][1] == "worker", log
    assert took["name"] == ("sgd", "worker") and took["nesterov"] == ("false", "worker"), log
    assert took["clip_norm"] == ("0", "default"), log  # neither the config nor the worker says
    d = rel_diff(final, replay("precedence_replay", init, by))
    print("replay precedence: %.3g" % d)
    assert d < TOL
    assert rel_diff(final, replay("precedence", init, by)) > 10 * TOL  # the offered lr 0.01 is not what ran


def test_an_offer_psd_refuses_ends_the_worker_with_2(tmp_path):
    """SGD(momentum=1.0): torch takes it, psd's config check does not (momentum in [0, 1)):
    the worker gets psd's refusal and exits 2."""
    r = Run(tmp_path, 1, config=CONFIG)
    try:
        w = r.worker("bad_momentum", str(tmp_path), script="replay_worker.py")
        o, e = w.communicate(timeout=60)
        assert w.returncode == 2, (o, e, r.psd_log())
        assert e.count("\n") == 1 and "psd refused" in e and "optimizer.momentum: 1.0" in e and "[0, 1)" in e, e
    finally:
        r.kill()


def test_zz_summary():
    """The measured differences, one line per case (pytest -s shows them)."""
    for case, d in RESULTS.items():
        print("%-18s %.3g" % (case, d))
