"""The optimizers and schedulers of the replay tests (test_optim_replay.py),
built the same way by the worker (replay_worker.py, which offers them to psd)
and by the test's plain-PyTorch replay: a 20-32-4 MLP on a synthetic task,
TRAIN samples in batches of BATCH, EPOCHS epochs (500 steps)."""
import torch
import torch.nn.functional as F

TRAIN, TEST, BATCH, EPOCHS = 400, 32, 8, 10
STEPS = TRAIN // BATCH * EPOCHS

S = torch.optim.lr_scheduler


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(20, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))  # smooth: no ReLU kink where float32 rounding flips a unit


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    w = torch.randn(20, 4, generator=torch.Generator().manual_seed(99))
    return x, (x @ w + 0.5 * torch.randn(n, 4, generator=g)).argmax(1)


def _groups(m, lrs, wds):
    """Three groups: fc1.weight, the biases, fc2.weight."""
    parts = [[m.fc1.weight], [m.fc1.bias, m.fc2.bias], [m.fc2.weight]]
    return [{"params": p, "lr": lr, "weight_decay": wd} for p, lr, wd in zip(parts, lrs, wds)]


def _sgd_plain(m):
    return torch.optim.SGD(m.parameters(), lr=0.05), None, "step", None


def _sgd_nesterov(m):
    o = torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9, nesterov=True, weight_decay=1e-3)
    return o, S.StepLR(o, step_size=100, gamma=0.5), "step", None


def _adam(m):
    o = torch.optim.Adam(m.parameters(), lr=2e-3, weight_decay=1e-4)
    return o, S.ExponentialLR(o, gamma=0.995), "step", None


def _adamw(m):
    o = torch.optim.AdamW(m.parameters(), lr=2e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)
    return o, S.CosineAnnealingLR(o, T_max=STEPS, eta_min=1e-4), "step", None


def _adagrad(m):
    o = torch.optim.Adagrad(m.parameters(), lr=0.05, eps=1e-9, weight_decay=1e-4)
    return o, S.MultiStepLR(o, milestones=[100, 250, 250], gamma=0.5), "step", None


def _constant(m):
    o = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    return o, S.ConstantLR(o, factor=0.25, total_iters=150), "step", None


def _linear(m):
    o = torch.optim.Adam(m.parameters(), lr=3e-3)
    return o, S.LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=200), "step", None


def _onecycle_sgd(m):
    o = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    return o, S.OneCycleLR(o, max_lr=0.1, total_steps=STEPS, pct_start=0.3), "step", None


def _onecycle_adam(m):
    o = torch.optim.Adam(m.parameters(), lr=1e-3)
    return o, S.OneCycleLR(o, max_lr=5e-3, total_steps=STEPS, pct_start=0.25, anneal_strategy="linear",
                           three_phase=True, div_factor=10.0, final_div_factor=100.0), "step", None


def _sequential(m):
    o = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01)
    a = S.LinearLR(o, start_factor=0.01, end_factor=1.0, total_iters=50)
    b = S.CosineAnnealingLR(o, T_max=STEPS - 50)
    return o, S.SequentialLR(o, schedulers=[a, b], milestones=[50]), "step", None


def _groups_sgd(m):
    o = torch.optim.SGD(_groups(m, [0.05, 0.1, 0.02], [1e-3, 0.0, 1e-2]), lr=0.05, momentum=0.9)
    return o, S.StepLR(o, step_size=150, gamma=0.3), "step", None


def _groups_adamw_clip(m):
    o = torch.optim.AdamW(_groups(m, [2e-3, 4e-3, 1e-3], [0.05, 0.0, 0.1]), lr=2e-3)
    return o, None, "step", 0.5


def _clip_sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), None, "step", 0.25


def _epoch_step(m):
    o = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    return o, S.StepLR(o, step_size=3, gamma=0.5), "epoch", None


def _epoch_cosine(m):
    o = torch.optim.Adam(m.parameters(), lr=3e-3)
    return o, S.CosineAnnealingLR(o, T_max=EPOCHS, eta_min=1e-4), "epoch", None


def _epoch_sequential(m):
    o = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5)
    a = S.ConstantLR(o, factor=0.5, total_iters=2)
    b = S.ExponentialLR(o, gamma=0.8)
    return o, S.SequentialLR(o, schedulers=[a, b], milestones=[3]), "epoch", None


def _precedence(m):
    """Offered: lr 0.01, weight_decay 0.1, momentum 0.5; psd's config sets optimizer.lr=0.05."""
    return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.5, weight_decay=0.1), None, "step", None


def _precedence_replay(m):
    """What psd runs for _precedence: the config's lr, the offer's others."""
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5, weight_decay=0.1), None, "step", None


def _nothing(m):
    """No offer: psd's config says the optimizer (the replay harness's control)."""
    return None, None, "step", None


def _nothing_replay(m):
    """What psd runs for _nothing with test_optim_replay.py's control config."""
    return torch.optim.Adam(m.parameters(), lr=2e-3, weight_decay=1e-4), None, "step", None


def _bad_momentum(m):
    """torch takes momentum 1.0; psd's check does not (momentum in [0, 1))."""
    return torch.optim.SGD(m.parameters(), lr=0.01, momentum=1.0), None, "step", None


CASES = {k[1:]: v for k, v in dict(globals()).items() if k.startswith("_") and callable(v) and
         k not in ("_groups",) and not k.startswith("__")}


def build(case, model):
    """(optimizer, scheduler or None, interval, clip_norm or None) of case on model."""
    return CASES[case](model)
