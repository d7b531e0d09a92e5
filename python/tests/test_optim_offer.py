"""psd.optim: the user's torch optimizer and scheduler as the YAML psd.torch
offers psd (no psd here: the mapping, and its refusals, on their own)."""
import bisect
import collections
import fnmatch
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import yaml  # python3-torch depends on python3-yaml

from psd.optim import MAX_GROUPS, Unsupported, offer_text

HERE = os.path.dirname(os.path.abspath(__file__))
S = torch.optim.lr_scheduler
pytestmark = [pytest.mark.filterwarnings("ignore:Detected call of .lr_scheduler.step"),
              pytest.mark.filterwarnings("ignore:The epoch parameter")]  # torch's own SequentialLR


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(20, 32)
        self.fc2 = torch.nn.Linear(32, 4)


class Deep(torch.nn.Module):
    """An embedding, layers with a norm each, and a head: names fit for globs."""

    def __init__(self, n=3):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({"lin": torch.nn.Linear(8, 8),
                                                              "norm": torch.nn.LayerNorm(8)}) for _ in range(n))
        self.head = torch.nn.Linear(8, 2)


class Loader(yaml.SafeLoader):
    """YAML 1.2's floats (1e-08 too, as psd reads them; PyYAML's 1.1 wants a dot)."""


Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$"),
                             list("-+0123456789."))


def load(text):
    return yaml.load(text, Loader=Loader)


def offer(model, opt, sched=None, interval="step", clip=None):
    text = offer_text(model.named_parameters(), opt, sched, interval, clip)
    assert text.endswith("\n") and len(text.encode()) <= 16384
    return load(text)


def refused(model, opt, sched=None, interval="step", clip=None):
    with pytest.raises(Unsupported) as e:
        offer_text(model.named_parameters(), opt, sched, interval, clip)
    msg = str(e.value)
    assert msg.startswith("psd: ") and "\n" not in msg, msg
    return msg


def settings(o, names):
    """Each tensor's (weight_decay, lr) as psd derives them from the offer: the first group whose
    match fits its name (fnmatchcase: '*' crosses dots, as fnmatch(3) without flags), else the defaults."""
    opt = o["optimizer"]
    out = {}
    for n in names:
        wd, scale = opt["weight_decay"], 1.0
        for g in opt.get("groups", []):
            if fnmatch.fnmatchcase(n, g["match"]):
                wd, scale = g["weight_decay"], g["lr_scale"]
                break
        out[n] = (wd, opt["lr"] * scale)
    return out


def torch_settings(model, opt, lr_key="lr"):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id[id(p)]: (g["weight_decay"], g[lr_key]) for g in opt.param_groups for p in g["params"]}


def same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][0] == b[k][0] and math.isclose(a[k][1], b[k][1], rel_tol=1e-15), (k, a[k], b[k])


# -- optimizers --------------------------------------------------------------------------------

def test_each_optimizer_offers_exactly_its_keys():
    m = Net()
    t = offer_text(m.named_parameters(), torch.optim.SGD(m.parameters(), lr=0.05))
    assert t == "optimizer: {name: sgd, lr: 0.05, momentum: 0.0, nesterov: false, weight_decay: 0.0}\n"
    o = offer(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4))
    assert o == {"optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4}}
    t = offer_text(m.named_parameters(), torch.optim.AdamW(m.parameters(), lr=3e-4))
    assert t == ("optimizer: {name: adamw, lr: 0.0003, beta1: 0.9, beta2: 0.999, eps: 1e-08, "
                 "weight_decay: 0.01}\n")
    o = offer(m, torch.optim.Adam(m.parameters(), lr=1e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=1e-4))
    assert o == {"optimizer": {"name": "adam", "lr": 1e-3, "beta1": 0.8, "beta2": 0.95, "eps": 1e-6,
                               "weight_decay": 1e-4}}
    o = offer(m, torch.optim.Adagrad(m.parameters(), lr=0.01))
    assert o == {"optimizer": {"name": "adagrad", "lr": 0.01, "eps": 1e-10, "weight_decay": 0.0}}


def test_numbers_round_trip_exactly():
    m = Net()
    lr = 0.1 + 0.2  # 0.30000000000000004
    t = offer_text(m.named_parameters(), torch.optim.SGD(m.parameters(), lr=lr, momentum=1 / 3))
    o = load(t)["optimizer"]
    assert o["lr"] == lr and o["momentum"] == 1 / 3 and "0.30000000000000004" in t


def test_clip_norm_and_nothing_to_offer():
    m = Net()
    assert offer(m, torch.optim.SGD(m.parameters(), lr=0.1), clip=1)["optimizer"]["clip_norm"] == 1.0
    assert offer_text(m.named_parameters(), None) is None
    assert offer_text(m.named_parameters(), None, clip_norm=2.5) == "optimizer: {clip_norm: 2.5}\n"
    assert "clip_norm" not in offer(m, torch.optim.SGD(m.parameters(), lr=0.1))["optimizer"]


def test_a_scheduler_as_one_line_of_torch():
    m = Net()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    d = offer(m, o, S.StepLR(o, 30), interval="epoch")
    assert d["schedule"] == {"name": "torch", "torch": "StepLR(step_size=30, gamma=0.1)", "interval": "epoch"}
    assert d["optimizer"]["lr"] == 0.1
    assert "schedule" not in offer(m, torch.optim.SGD(m.parameters(), lr=0.1))


# -- groups ------------------------------------------------------------------------------------

def test_no_decay_on_biases_is_one_glob():
    m = Net()
    decay = [p for n, p in m.named_parameters() if n.endswith("weight")]
    no = [p for n, p in m.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no, "weight_decay": 0.0}], lr=3e-4, weight_decay=0.05)
    o = offer(m, opt)
    assert o["optimizer"]["weight_decay"] == 0.05 and o["optimizer"]["lr"] == 3e-4
    assert o["optimizer"]["groups"] == [{"match": "*.bias", "weight_decay": 0.0, "lr_scale": 1.0}]


def test_the_group_of_the_most_tensors_is_the_default():
    m = Deep()
    names = [n for n, _ in m.named_parameters()]
    head = [p for n, p in m.named_parameters() if n.startswith("head.")]
    rest = [p for n, p in m.named_parameters() if not n.startswith("head.")]
    opt = torch.optim.SGD([{"params": head, "lr": 1.0, "weight_decay": 0.01}, {"params": rest}], lr=0.1,
                          momentum=0.9)
    o = offer(m, opt)
    assert o["optimizer"]["lr"] == 0.1 and o["optimizer"]["weight_decay"] == 0.0
    # head.weight and head.bias: not every *.weight nor *.bias is the head's, so by name
    assert o["optimizer"]["groups"] == [{"match": "head.weight", "weight_decay": 0.01, "lr_scale": 10.0},
                                        {"match": "head.bias", "weight_decay": 0.01, "lr_scale": 10.0}]
    same(settings(o, names), torch_settings(m, opt))


def test_groups_of_the_same_settings_compress_together():
    """Groups of equal lr and weight_decay are one: the norms' two groups and the biases' (7
    tensors) outnumber the weights' (3), so they are the default; the weights and the embedding
    by name (not every *.weight is theirs)."""
    m = Deep(n=2)
    names = [n for n, _ in m.named_parameters()]
    P = dict(m.named_parameters())
    norms = [[P["blocks.%d.norm.weight" % i], P["blocks.%d.norm.bias" % i]] for i in range(2)]
    biases = [P[n] for n in names if n.endswith(".bias") and ".norm." not in n]
    weights = [P[n] for n in names if n.endswith(".weight") and ".norm." not in n and n != "embed.weight"]
    opt = torch.optim.AdamW([{"params": weights},
                             {"params": norms[0], "weight_decay": 0.0},
                             {"params": biases, "weight_decay": 0.0},
                             {"params": norms[1], "weight_decay": 0.0},
                             {"params": [P["embed.weight"]], "lr": 3e-3, "weight_decay": 0.0}],
                            lr=1e-3, weight_decay=0.1)
    o = offer(m, opt)
    assert o["optimizer"]["lr"] == 1e-3 and o["optimizer"]["weight_decay"] == 0.0
    assert o["optimizer"]["groups"] == [
        {"match": "blocks.0.lin.weight", "weight_decay": 0.1, "lr_scale": 1.0},
        {"match": "blocks.1.lin.weight", "weight_decay": 0.1, "lr_scale": 1.0},
        {"match": "head.weight", "weight_decay": 0.1, "lr_scale": 1.0},
        {"match": "embed.weight", "weight_decay": 0.0, "lr_scale": 3.0}], o
    same(settings(o, names), torch_settings(m, opt))
    # the norms alone with an lr of their own: by name (the other *.weight and *.bias are the default's)
    opt = torch.optim.AdamW([{"params": weights + [P["embed.weight"]] + biases},
                             {"params": norms[0] + norms[1], "lr": 2e-3, "weight_decay": 0.0}], lr=1e-3)
    o = offer(m, opt)
    assert [g["match"] for g in o["optimizer"]["groups"]] == [
        "blocks.0.norm.weight", "blocks.0.norm.bias", "blocks.1.norm.weight", "blocks.1.norm.bias"], o
    same(settings(o, names), torch_settings(m, opt))


def test_a_group_like_the_default_needs_no_entry():
    m = Net()
    opt = torch.optim.SGD([{"params": [m.fc1.weight, m.fc2.weight]}, {"params": [m.fc1.bias]},
                           {"params": [m.fc2.bias], "lr": 0.2}], lr=0.1)
    o = offer(m, opt)
    assert o["optimizer"]["groups"] == [{"match": "fc2.bias", "weight_decay": 0.0, "lr_scale": 2.0}]


@pytest.mark.parametrize("layout", range(6))
def test_groups_give_every_tensor_its_torch_settings(layout):
    """Random group layouts of a deeper model: the first-match reading of the offer gives every
    tensor its group's lr and weight_decay."""
    g = torch.Generator().manual_seed(layout)
    m = Deep(n=4)
    params = list(m.named_parameters())
    k = 2 + layout % 4
    pick = torch.randint(0, k, (len(params),), generator=g).tolist()
    if layout % 2:  # by name: every bias to one group
        pick = [0 if n.endswith(".bias") else c for (n, _), c in zip(params, pick)]
    lrs = [0.01, 0.02, 0.01, 0.05, 0.001][:k]
    wds = [0.0, 0.1, 0.0, 0.0, 0.2][:k]
    groups = [{"params": [p for (n, p), c in zip(params, pick) if c == j], "lr": lrs[j], "weight_decay": wds[j]}
              for j in range(k)]
    opt = torch.optim.SGD([x for x in groups if x["params"]], lr=0.1)
    o = offer(m, opt)
    same(settings(o, [n for n, _ in params]), torch_settings(m, opt))
    count = collections.Counter(pick)
    best = max(count.values())
    assert any(o["optimizer"]["lr"] == lrs[j] and count[j] == best for j in count)


def test_names_with_glob_characters_are_escaped():
    m = torch.nn.Module()
    m.add_module("a[0]", torch.nn.Linear(2, 2))
    m.add_module("b*", torch.nn.Linear(2, 2))
    m.add_module("b?", torch.nn.Linear(2, 2))
    names = [n for n, _ in m.named_parameters()]
    P = dict(m.named_parameters())
    opt = torch.optim.SGD([{"params": [P["a[0].weight"], P["b*.weight"], P["b?.bias"], P["b?.weight"]]},
                           {"params": [P["a[0].bias"], P["b*.bias"]], "lr": 0.5}], lr=0.1)
    o = offer(m, opt)
    assert [x["match"] for x in o["optimizer"]["groups"]] == ["a[[]0[]].bias", "b[*].bias"]
    same(settings(o, names), torch_settings(m, opt))


def test_more_than_64_entries_is_refused():
    m = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(MAX_GROUPS + 2)])
    groups = [{"params": [x.weight], "lr": 0.1 * (1 + i)} for i, x in enumerate(m)]
    groups.append({"params": [x.bias for x in m]})
    opt = torch.optim.SGD(groups, lr=0.05)
    msg = refused(m, opt)
    assert "66 optimizer.groups entries" in msg and "64" in msg, msg
    # the same groups by the names' last part fit in one entry each
    m2 = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(MAX_GROUPS + 2)])
    opt = torch.optim.SGD([{"params": [x.weight for x in m2], "lr": 0.2}, {"params": [x.bias for x in m2]}], lr=0.1)
    assert [x["match"] for x in offer(m2, opt)["optimizer"].get("groups", [])] in (["*.weight"], ["*.bias"])


# -- schedulers --------------------------------------------------------------------------------

def _sched(make, opt_make=None):
    m = Net()
    opt = (opt_make or (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)))(m.parameters())
    return offer(m, opt, make(opt))


@pytest.mark.parametrize("make,text", [
    (lambda o: S.StepLR(o, step_size=30, gamma=0.5), "StepLR(step_size=30, gamma=0.5)"),
    (lambda o: S.MultiStepLR(o, milestones=[50, 20, 50], gamma=0.3), "MultiStepLR(milestones=[20, 50, 50], gamma=0.3)"),
    (lambda o: S.ExponentialLR(o, gamma=0.99), "ExponentialLR(gamma=0.99)"),
    (lambda o: S.ConstantLR(o, factor=0.25, total_iters=7), "ConstantLR(factor=0.25, total_iters=7)"),
    (lambda o: S.ConstantLR(o), "ConstantLR(factor=0.3333333333333333, total_iters=5)"),
    (lambda o: S.LinearLR(o, start_factor=0.01, end_factor=0.5, total_iters=100),
     "LinearLR(start_factor=0.01, end_factor=0.5, total_iters=100)"),
    (lambda o: S.CosineAnnealingLR(o, T_max=500), "CosineAnnealingLR(T_max=500, eta_min=0.0)"),
    (lambda o: S.CosineAnnealingLR(o, T_max=500, eta_min=1e-5), "CosineAnnealingLR(T_max=500, eta_min=1e-05)"),
    (lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.1, total_iters=10), S.CosineAnnealingLR(o, 90)],
                              milestones=[10]),
     "SequentialLR(schedulers=[LinearLR(start_factor=0.1, end_factor=1.0, total_iters=10), "
     "CosineAnnealingLR(T_max=90, eta_min=0.0)], milestones=[10])"),
    (lambda o: S.SequentialLR(o, [S.ConstantLR(o, factor=0.5, total_iters=2), S.ExponentialLR(o, gamma=0.9),
                                  S.StepLR(o, 5)], milestones=[2, 20]),
     "SequentialLR(schedulers=[ConstantLR(factor=0.5, total_iters=2), ExponentialLR(gamma=0.9), "
     "StepLR(step_size=5, gamma=0.1)], milestones=[2, 20])"),
])
def test_each_scheduler_text(make, text):
    d = _sched(make)
    assert d["schedule"] == {"name": "torch", "torch": text, "interval": "step"}
    assert d["optimizer"]["lr"] == 0.1  # the base lr, not the one a scheduler set at its start


def test_onecycle_with_sgd_cycles_momentum():
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    d = offer(m, opt, S.OneCycleLR(opt, max_lr=0.3, total_steps=7, pct_start=0.3))
    assert d["optimizer"]["lr"] == 0.3 and d["optimizer"]["momentum"] == 0.95 and d["optimizer"]["nesterov"] is True
    assert d["schedule"]["torch"] == (
        "OneCycleLR(total_steps=7, pct_start=0.3, anneal_strategy='cos', cycle_momentum=True, base_momentum=0.85, "
        "max_momentum=0.95, div_factor=25.0, final_div_factor=10000.0, three_phase=False)")


def test_onecycle_with_adam_linear_three_phase():
    m = Net()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, betas=(0.9, 0.98))
    sched = S.OneCycleLR(opt, max_lr=5e-3, total_steps=1000, pct_start=0.15, anneal_strategy="linear",
                         base_momentum=0.8, max_momentum=0.9, div_factor=10.0, final_div_factor=1e3, three_phase=True)
    d = offer(m, opt, sched)
    assert d["optimizer"]["lr"] == 5e-3 and d["optimizer"]["beta1"] == 0.9 and d["optimizer"]["beta2"] == 0.98
    assert d["schedule"]["torch"] == (
        "OneCycleLR(total_steps=1000, pct_start=0.15, anneal_strategy='linear', cycle_momentum=True, "
        "base_momentum=0.8, max_momentum=0.9, div_factor=10.0, final_div_factor=1000.0, three_phase=True)")


def test_onecycle_without_momentum_and_from_epochs():
    m = Net()
    opt = torch.optim.Adagrad(m.parameters(), lr=1e-2)
    sched = S.OneCycleLR(opt, max_lr=0.07, epochs=3, steps_per_epoch=33, cycle_momentum=False, div_factor=7.0,
                         final_div_factor=3.0)
    d = offer(m, opt, sched)
    assert d["optimizer"]["lr"] == 0.07
    assert d["schedule"]["torch"] == (
        "OneCycleLR(total_steps=99, pct_start=0.3, anneal_strategy='cos', cycle_momentum=False, div_factor=7.0, "
        "final_div_factor=3.0, three_phase=False)")


def test_onecycle_groups_scale_by_max_lr():
    m = Net()
    opt = torch.optim.SGD([{"params": [m.fc1.weight, m.fc2.weight]}, {"params": [m.fc1.bias, m.fc2.bias]}],
                          lr=0.01, momentum=0.9)
    d = offer(m, opt, S.OneCycleLR(opt, max_lr=[0.4, 0.1], total_steps=100))
    assert d["optimizer"]["lr"] == 0.4
    assert d["optimizer"]["groups"] == [{"match": "*.bias", "weight_decay": 0.0, "lr_scale": 0.25}]


def test_scheduler_groups_scale_by_base_lr():
    m = Net()
    opt = torch.optim.Adam([{"params": [m.fc1.weight, m.fc2.weight, m.fc2.bias]}, {"params": [m.fc1.bias],
                                                                                     "lr": 3e-3}], lr=1e-3)
    d = offer(m, opt, S.LinearLR(opt, start_factor=0.1, total_iters=10))
    assert d["optimizer"]["lr"] == 1e-3
    assert d["optimizer"]["groups"] == [{"match": "fc1.bias", "weight_decay": 0.0, "lr_scale": 3e-3 / 1e-3}]


def test_a_bad_interval_is_refused():
    m = Net()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    assert "scheduler_interval='batch'" in refused(m, o, S.StepLR(o, 3), interval="batch")


# -- refusals ----------------------------------------------------------------------------------

class MySGD(torch.optim.SGD):
    pass


def _lambda(o):
    return S.LambdaLR(o, lambda e: 1.0)


@pytest.mark.parametrize("make,words", [
    (lambda p: torch.optim.RMSprop(p, lr=0.1), ["the optimizer RMSprop", "SGD, Adam, AdamW and Adagrad"]),
    (lambda p: torch.optim.Adamax(p, lr=0.1), ["the optimizer Adamax"]),
    (lambda p: MySGD(p, lr=0.1), ["the optimizer MySGD"]),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), ["SGD(dampening=0.1)", "dampening 0"]),
    (lambda p: torch.optim.Adam(p, lr=0.1, amsgrad=True), ["Adam(amsgrad=True)"]),
    (lambda p: torch.optim.AdamW(p, lr=0.1, amsgrad=True), ["AdamW(amsgrad=True)"]),
    (lambda p: torch.optim.SGD(p, lr=0.1, maximize=True), ["SGD(maximize=True)"]),
    (lambda p: torch.optim.Adam(p, lr=0.1, maximize=True), ["Adam(maximize=True)"]),
    (lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01), ["Adagrad(lr_decay=0.01)"]),
    (lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1),
     ["Adagrad(initial_accumulator_value=0.1)"]),
    (lambda p: torch.optim.SGD(p, lr=0.0), ["SGD group 0 has lr 0.0", "> 0"]),
])
def test_an_optimizer_psd_does_not_run_is_refused(make, words):
    m = Net()
    msg = refused(m, make(m.parameters()))
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("extra,key", [
    ({"momentum": 0.5}, "momentum"), ({"nesterov": False}, "nesterov"),
])
def test_per_group_momentum_is_refused(extra, key):
    m = Net()
    g = dict({"params": [m.fc1.bias, m.fc2.bias]}, **extra)
    opt = torch.optim.SGD([{"params": [m.fc1.weight, m.fc2.weight]}, g], lr=0.1, momentum=0.9, nesterov=True)
    msg = refused(m, opt)
    assert "group 1 has %s" % key in msg and "lr and weight_decay" in msg, msg


@pytest.mark.parametrize("extra,key", [({"betas": (0.8, 0.999)}, "beta1"), ({"betas": (0.9, 0.99)}, "beta2"),
                                       ({"eps": 1e-6}, "eps")])
def test_per_group_betas_and_eps_are_refused(extra, key):
    m = Net()
    g = dict({"params": [m.fc1.bias, m.fc2.bias]}, **extra)
    msg = refused(m, torch.optim.Adam([{"params": [m.fc1.weight, m.fc2.weight]}, g], lr=0.1))
    assert "Adam: group 1 has %s" % key in msg, msg


def test_a_parameter_in_no_group_or_not_the_models_is_refused():
    m = Net()
    msg = refused(m, torch.optim.SGD([m.fc1.weight, m.fc1.bias, m.fc2.weight], lr=0.1))
    assert "parameter fc2.bias is in no group of the SGD" in msg, msg
    stranger = torch.nn.Parameter(torch.zeros(3, 2))
    msg = refused(m, torch.optim.SGD(list(m.parameters()) + [stranger], lr=0.1))
    assert "SGD group 0 holds a tensor (shape (3, 2)) that is not a parameter of the model" in msg, msg


@pytest.mark.parametrize("make,name", [
    (lambda o: S.ReduceLROnPlateau(o), "ReduceLROnPlateau"),
    (lambda o: S.CyclicLR(o, 0.01, 0.1), "CyclicLR"),
    (_lambda, "LambdaLR"),
    (lambda o: S.MultiplicativeLR(o, lambda e: 0.9), "MultiplicativeLR"),
    (lambda o: S.ChainedScheduler([S.StepLR(o, 3), S.ExponentialLR(o, 0.9)]), "ChainedScheduler"),
    (lambda o: S.CosineAnnealingWarmRestarts(o, 10), "CosineAnnealingWarmRestarts"),
    (lambda o: S.PolynomialLR(o, 10), "PolynomialLR"),
])
def test_a_scheduler_psd_does_not_run_is_refused(make, name):
    m = Net()
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    msg = refused(m, o, make(o))
    assert msg == ("psd: the scheduler %s is not one psd runs (it runs StepLR, MultiStepLR, ExponentialLR, ConstantLR, "
                   "LinearLR, CosineAnnealingLR, OneCycleLR, SequentialLR of those)" % name), msg


def test_a_stepped_scheduler_is_refused():
    m = Net()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = S.StepLR(o, 3)
    o.step()
    s.step()
    assert "the scheduler StepLR was stepped already (last_epoch 1)" in refused(m, o, s)


def test_schedulers_psd_cannot_nest_are_refused():
    m = Net()
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    inner = S.SequentialLR(o, [S.StepLR(o, 3), S.StepLR(o, 4)], milestones=[5])
    msg = refused(m, o, S.SequentialLR(o, [inner, S.StepLR(o, 2)], milestones=[10]))
    assert "SequentialLR of SequentialLR" in msg, msg
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    msg = refused(m, o, S.SequentialLR(o, [S.ConstantLR(o), S.OneCycleLR(o, max_lr=0.1, total_steps=10)],
                                       milestones=[5]))
    assert "OneCycleLR(cycle_momentum=True)" in msg, msg


def test_a_scheduler_of_another_optimizer_or_none_is_refused():
    m = Net()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    other = torch.optim.SGD(m.parameters(), lr=0.1)
    assert "not the optimizer's" in refused(m, o, S.StepLR(other, 3))
    with pytest.raises(Unsupported, match="scheduler= without optimizer="):
        offer_text(m.named_parameters(), None, S.StepLR(other, 3))


def test_cosine_floor_with_group_lrs_is_refused():
    m = Net()
    o = torch.optim.SGD([{"params": [m.fc1.weight, m.fc2.weight]}, {"params": [m.fc1.bias, m.fc2.bias], "lr": 0.5}],
                        lr=0.1)
    assert "eta_min > 0" in refused(m, o, S.CosineAnnealingLR(o, 10, eta_min=1e-3))
    o = torch.optim.SGD([{"params": [m.fc1.weight, m.fc2.weight]}, {"params": [m.fc1.bias, m.fc2.bias], "lr": 0.5}],
                        lr=0.1)
    assert offer(m, o, S.CosineAnnealingLR(o, 10))["optimizer"]["groups"][0]["lr_scale"] == 5.0


@pytest.mark.parametrize("clip", [0, -1.0, float("inf"), True])
def test_a_bad_clip_norm_is_refused(clip):
    m = Net()
    refused(m, torch.optim.SGD(m.parameters(), lr=0.1), clip=clip)


# -- the Worker --------------------------------------------------------------------------------

def test_the_worker_refuses_before_it_registers(tmp_path):
    """Worker(scheduler=ReduceLROnPlateau): RunError(exit 2) at once, nothing listening; as a script
    it exits 2 with the one line on stderr (psd.torch's excepthook)."""
    import psd.torch as pst
    m = Net()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(pst.RunError) as e:
        pst.Worker("tcp://127.0.0.1:9", m, 10, 10, optimizer=o, scheduler=S.ReduceLROnPlateau(o), timeout_s=1)
    assert e.value.exit_code == 2 and str(e.value).startswith("psd: the scheduler ReduceLROnPlateau is not one")
    p = subprocess.run([sys.executable, os.path.join(HERE, "replay_worker.py"), "tcp://127.0.0.1:9", "plateau",
                        str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr == ("psd: the scheduler ReduceLROnPlateau is not one psd runs (it runs StepLR, MultiStepLR, "
                        "ExponentialLR, ConstantLR, LinearLR, CosineAnnealingLR, OneCycleLR, SequentialLR of "
                        "those)\n"), p.stderr


# -- the texts' meaning: psd's closed forms (the contract) against PyTorch's own lrs -----------

def _closed_forms(lr):
    """The schedule texts as psd reads them: each constructor a function of k (the step or epoch)
    giving (factor of optimizer.lr, momentum or None)."""
    def step(step_size, gamma):
        return lambda k: (gamma ** (k // step_size), None)

    def multistep(milestones, gamma):
        return lambda k: (gamma ** bisect.bisect_right(sorted(milestones), k), None)

    def exponential(gamma):
        return lambda k: (gamma ** k, None)

    def constant(factor, total_iters):
        return lambda k: (factor if k < total_iters else 1.0, None)

    def linear(start_factor, end_factor, total_iters):
        return lambda k: (start_factor + (end_factor - start_factor) * min(k, total_iters) / total_iters, None)

    def cosine(T_max, eta_min):
        e = eta_min / lr
        return lambda k: (e + (1 - e) * (1 + math.cos(math.pi * k / T_max)) / 2, None)

    def onecycle(total_steps, pct_start, anneal_strategy, cycle_momentum, div_factor, final_div_factor, three_phase,
                 base_momentum=None, max_momentum=None):
        def anneal(a, b, pct):
            return (b + (a - b) / 2 * (math.cos(math.pi * pct) + 1)) if anneal_strategy == "cos" else (b - a) * pct + a
        lo, end = 1 / div_factor, 1 / div_factor / final_div_factor
        up = float(pct_start * total_steps) - 1
        phases = ([(up, lo, 1.0, max_momentum, base_momentum), (float(2 * pct_start * total_steps) - 2, 1.0, lo,
                   base_momentum, max_momentum), (total_steps - 1, lo, end, max_momentum, max_momentum)] if three_phase
                  else [(up, lo, 1.0, max_momentum, base_momentum), (total_steps - 1, 1.0, end, base_momentum,
                                                                     max_momentum)])

        def f(k):
            start = 0
            for i, (stop, a, b, ma, mb) in enumerate(phases):
                if k <= stop or i == len(phases) - 1:
                    pct = (k - start) / (stop - start)
                    return anneal(a, b, pct), (anneal(ma, mb, pct) if cycle_momentum else None)
                start = stop
        return f

    def sequential(schedulers, milestones):
        def f(k):
            i = bisect.bisect_right(milestones, k)
            return schedulers[i](k - (milestones[i - 1] if i else 0))
        return f

    return {"StepLR": step, "MultiStepLR": multistep, "ExponentialLR": exponential, "ConstantLR": constant,
            "LinearLR": linear, "CosineAnnealingLR": cosine, "OneCycleLR": onecycle, "SequentialLR": sequential,
            "True": True, "False": False}


@pytest.mark.parametrize("make", [
    lambda o: S.StepLR(o, step_size=7, gamma=0.5),
    lambda o: S.MultiStepLR(o, milestones=[30, 10, 30], gamma=0.3),
    lambda o: S.ExponentialLR(o, gamma=0.97),
    lambda o: S.ConstantLR(o, factor=0.25, total_iters=17),
    lambda o: S.LinearLR(o, start_factor=0.01, end_factor=0.5, total_iters=40),
    lambda o: S.CosineAnnealingLR(o, T_max=60),
    lambda o: S.OneCycleLR(o, max_lr=[0.3, 0.6], total_steps=60, pct_start=0.3),
    lambda o: S.OneCycleLR(o, max_lr=[0.3, 0.6], total_steps=61, pct_start=0.17, anneal_strategy="linear",
                           three_phase=True, div_factor=7.0, final_div_factor=300.0, base_momentum=0.7,
                           max_momentum=0.85),
    lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.1, total_iters=10), S.CosineAnnealingLR(o, 50)],
                             milestones=[10]),
    lambda o: S.SequentialLR(o, [S.ConstantLR(o, factor=0.5, total_iters=4), S.ExponentialLR(o, gamma=0.9),
                                 S.MultiStepLR(o, milestones=[5, 9], gamma=0.5)], milestones=[6, 30]),
], ids=["step", "multistep", "exponential", "constant", "linear", "cosine", "onecycle", "onecycle3", "seq", "seq3"])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_the_text_gives_pytorchs_learning_rates(make, opt_name):
    """lr of step k = optimizer.lr * lr_scale * factor(k) (psd's reading of the offer) is each group's
    lr PyTorch steps with at k, for 60 steps; with OneCycleLR's cycle_momentum, momentum (SGD) or
    beta1 (Adam) too."""
    m = Net()
    groups = [{"params": [m.fc1.weight, m.fc2.weight]}, {"params": [m.fc1.bias, m.fc2.bias], "lr": 0.2}]
    opt = (torch.optim.SGD(groups, lr=0.1, momentum=0.9) if opt_name == "sgd" else
           torch.optim.Adam(groups, lr=0.1, betas=(0.9, 0.99)))
    sched = make(opt)
    o = offer(m, opt, sched)
    per = settings(o, [n for n, _ in m.named_parameters()])
    group_lr = [per["fc1.weight"][1], per["fc1.bias"][1]]  # optimizer.lr * lr_scale of each group
    f = eval(o["schedule"]["torch"], {"__builtins__": {}}, _closed_forms(o["optimizer"]["lr"]))
    for k in range(60):
        factor, mom = f(k)
        for g, base in zip(opt.param_groups, group_lr):
            assert math.isclose(g["lr"], base * factor, rel_tol=1e-9, abs_tol=1e-15), (k, g["lr"], base * factor)
            if mom is not None:
                assert math.isclose(g["momentum"] if opt_name == "sgd" else g["betas"][0], mom, rel_tol=1e-9), k
        opt.step()
        sched.step()
