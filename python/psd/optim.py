"""The user's torch optimizer and LR scheduler as psd's optimizer and schedule.

psd.torch.Worker(..., optimizer=opt, scheduler=sched) offers them to psd
(psw_client_offer_config): psd holds the optimizer and steps it itself, under
the keys its own config sets (config > the worker's offer > psd's defaults).
offer_text() maps the torch objects to that offer, a YAML text of optimizer.*
and schedule.* keys, or raises Unsupported (one line: what, and what psd
runs) for anything psd would not run exactly as PyTorch does: nothing is
approximated.

    optimizers: torch.optim.SGD (dampening 0), Adam, AdamW (amsgrad off),
                Adagrad (lr_decay 0, initial_accumulator_value 0); maximize off;
                momentum, nesterov, betas and eps the same in every group
    groups:     each group's lr and weight_decay (the group with the most
                tensors gives optimizer.lr and optimizer.weight_decay; the others
                become optimizer.groups entries, "*.S" where a group holds every
                tensor named *.S, else the tensors' own names)
    schedulers: StepLR, MultiStepLR, ExponentialLR, ConstantLR, LinearLR,
                CosineAnnealingLR, OneCycleLR, SequentialLR of those (not of
                OneCycleLR with cycle_momentum)

Works with torch 1.13 and 2.x (their attribute names differ in places).
"""
import collections
import math
import numbers

__all__ = ["offer_text", "Unsupported", "MAX_GROUPS", "MAX_TEXT"]

MAX_GROUPS = 64      # PS_GROUPS_MAX: optimizer.groups entries psd takes
MAX_TEXT = 16384     # PSW_OFFER_CONFIG_MAX: bytes of the offer's YAML

SCHEDULERS = ("StepLR", "MultiStepLR", "ExponentialLR", "ConstantLR", "LinearLR", "CosineAnnealingLR", "OneCycleLR",
              "SequentialLR")
_RUNS_SCHED = ("it runs StepLR, MultiStepLR, ExponentialLR, ConstantLR, LinearLR, CosineAnnealingLR, OneCycleLR, "
               "SequentialLR of those")
_RUNS_OPT = "it runs torch.optim.SGD, Adam, AdamW and Adagrad"


class Unsupported(ValueError):
    """The optimizer, scheduler or an argument is not one psd runs exactly; the message is one line."""


def _refuse(fmt, *args):
    raise Unsupported("psd: " + (fmt % args if args else fmt))


def _f(x):
    """A float as psd reads it back exactly (repr round-trips); torch 2.x may hold tensors."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        _refuse("%r is not a number", x)
    if not math.isfinite(v):
        _refuse("%r is not a finite number", v)
    return v


def _num(x):
    """A number of a scheduler's text: an int as an int, any other number as repr(float)."""
    if isinstance(x, bool):
        return "True" if x else "False"
    if isinstance(x, numbers.Integral):
        return str(int(x))
    return repr(_f(x))


def _qs(s):
    """A YAML double-quoted scalar (JSON's escapes are YAML's)."""
    return '"%s"' % "".join(c if c not in '"\\' and 32 <= ord(c) < 127 else
                            ('\\' + c if c in '"\\' else '\\u%04x' % ord(c) if ord(c) < 0x10000 else
                             '\\U%08x' % ord(c)) for c in s)


def _escape(name):
    """A tensor name as an fnmatch(3) pattern that fits it alone."""
    out = []
    for c in name:
        if c in "*?[":
            out.append("[%s]" % c)
        elif c == "]":
            out.append("[]]")
        elif c == "\\":
            out.append("\\\\")
        else:
            out.append(c)
    return "".join(out)


def _cls(obj):
    return type(obj).__name__


def _exact(value, ok):
    """The shortest decimal round(value, k) that ok() accepts
    (a factor torch stored only through a product: div_factor from max_lr /
    initial_lr), else value."""
    for k in range(1, 18):
        c = round(value, k)
        if c > 0 and ok(c):
            return c
    return value


# -- the optimizer --------------------------------------------------------------------------------

def _optimizer_kind(opt):
    """psd's name of opt and the run-wide keys every group must share: [(psd key, torch group key, index)]."""
    import torch
    t = type(opt)
    if t is torch.optim.SGD:
        return "sgd", [("momentum", "momentum", None), ("nesterov", "nesterov", None)]
    if t is torch.optim.Adam or t is torch.optim.AdamW:
        dec = opt.defaults.get("decoupled_weight_decay", t is torch.optim.AdamW)  # torch >= 2.6: Adam(decoupled_..)
        return ("adamw" if dec else "adam"), [("beta1", "betas", 0), ("beta2", "betas", 1), ("eps", "eps", None)]
    if t is torch.optim.Adagrad:
        return "adagrad", [("eps", "eps", None)]
    _refuse("the optimizer %s is not one psd runs (%s)", _cls(opt), _RUNS_OPT)


def _check_group(opt, name, g, k):
    """The settings of group k that psd has no key for: refused unless PyTorch's defaults."""
    cls = _cls(opt)
    if g.get("maximize", False):
        _refuse("%s(maximize=True) (group %d): psd minimizes", cls, k)
    if name == "sgd" and _f(g.get("dampening", 0)) != 0:
        _refuse("SGD(dampening=%r) (group %d): psd runs SGD with dampening 0", g["dampening"], k)
    if name in ("adam", "adamw") and g.get("amsgrad", False):
        _refuse("%s(amsgrad=True) (group %d): psd runs Adam and AdamW without amsgrad", cls, k)
    if name == "adagrad":
        if _f(g.get("lr_decay", 0)) != 0:
            _refuse("Adagrad(lr_decay=%r) (group %d): psd runs Adagrad with lr_decay 0", g["lr_decay"], k)
        if _f(g.get("initial_accumulator_value", 0)) != 0:
            _refuse("Adagrad(initial_accumulator_value=%r) (group %d): psd runs Adagrad with "
                    "initial_accumulator_value 0", g["initial_accumulator_value"], k)


def _run_value(g, key, idx):
    v = g[key]
    if idx is not None:
        v = v[idx]
    return bool(v) if key == "nesterov" else _f(v)


# -- the scheduler --------------------------------------------------------------------------------

def _onecycle_linear(s):
    kind = getattr(s, "_anneal_func_type", None)  # torch >= 2.2
    if kind is None:
        f = getattr(s, "anneal_func", None)
        kind = {"_annealing_cos": "cos", "_annealing_linear": "linear"}.get(getattr(f, "__name__", ""), None)
    if kind not in ("cos", "linear"):
        _refuse("OneCycleLR: cannot tell its anneal_strategy (%r)", kind)
    return kind


def _onecycle(s, groups):
    """OneCycleLR's constructor text; its learning rates are the groups' max_lr."""
    g0 = groups[0]
    total = int(s.total_steps)
    ph = s._schedule_phases
    three = len(ph) == 3
    end0 = ph[0]["end_step"]
    pct = _exact((end0 + 1) / total, lambda c: float(c * total) - 1 == end0)
    max_lr, init, low = _f(g0["max_lr"]), _f(g0["initial_lr"]), _f(g0["min_lr"])
    div = _exact(max_lr / init, lambda c: max_lr / c == init)
    fdiv = _exact(init / low, lambda c: init / c == low)
    for k, g in enumerate(groups):
        if not (math.isclose(_f(g["max_lr"]) / _f(g["initial_lr"]), div, rel_tol=1e-12) and
                math.isclose(_f(g["initial_lr"]) / _f(g["min_lr"]), fdiv, rel_tol=1e-12)):
            _refuse("OneCycleLR: group %d has other div_factor or final_div_factor than group 0: psd runs one", k)
    text = "OneCycleLR(total_steps=%d, pct_start=%s, anneal_strategy='%s', cycle_momentum=%s" % (
        total, repr(pct), _onecycle_linear(s), bool(s.cycle_momentum))
    if s.cycle_momentum:
        bm, mm = _f(g0["base_momentum"]), _f(g0["max_momentum"])
        for k, g in enumerate(groups):
            if _f(g["base_momentum"]) != bm or _f(g["max_momentum"]) != mm:
                _refuse("OneCycleLR: group %d has other base_momentum or max_momentum than group 0: psd runs one", k)
        text += ", base_momentum=%s, max_momentum=%s" % (repr(bm), repr(mm))
    return text + ", div_factor=%s, final_div_factor=%s, three_phase=%s)" % (repr(div), repr(fdiv), three)


def _sched_text(s, opt, nested):
    """(constructor text, the groups' learning rates its factors are relative to, eta_mins > 0 seen)."""
    import torch.optim.lr_scheduler as S
    cls = _cls(s)
    known = {n: getattr(S, n, None) for n in SCHEDULERS}
    if type(s) not in [c for c in known.values() if c is not None]:
        _refuse("the scheduler %s is not one psd runs (%s)", cls, _RUNS_SCHED)
    if not nested and getattr(s, "last_epoch", None) != 0:
        _refuse("the scheduler %s was stepped already (last_epoch %s): give psd one not stepped yet",
                cls, getattr(s, "last_epoch", None))
    if getattr(s, "optimizer", None) is not opt:
        _refuse("the scheduler %s is not the optimizer's (it was made for another optimizer)", cls)
    groups = opt.param_groups
    base = getattr(s, "base_lrs", None)
    floor = False
    if cls == "StepLR":
        text = "StepLR(step_size=%s, gamma=%s)" % (_num(s.step_size), repr(_f(s.gamma)))
    elif cls == "MultiStepLR":
        ms = sorted(collections.Counter(s.milestones).elements())
        text = "MultiStepLR(milestones=[%s], gamma=%s)" % (", ".join(_num(m) for m in ms), repr(_f(s.gamma)))
    elif cls == "ExponentialLR":
        text = "ExponentialLR(gamma=%s)" % repr(_f(s.gamma))
    elif cls == "ConstantLR":
        text = "ConstantLR(factor=%s, total_iters=%s)" % (repr(_f(s.factor)), _num(s.total_iters))
    elif cls == "LinearLR":
        text = "LinearLR(start_factor=%s, end_factor=%s, total_iters=%s)" % (
            repr(_f(s.start_factor)), repr(_f(s.end_factor)), _num(s.total_iters))
    elif cls == "CosineAnnealingLR":
        text = "CosineAnnealingLR(T_max=%s, eta_min=%s)" % (_num(s.T_max), repr(_f(s.eta_min)))
        floor = _f(s.eta_min) != 0
    elif cls == "OneCycleLR":
        if nested and s.cycle_momentum:
            _refuse("SequentialLR of OneCycleLR(cycle_momentum=True): psd runs OneCycleLR with cycle_momentum "
                    "on its own only")
        text = _onecycle(s, groups)
        base = [_f(g["max_lr"]) for g in groups]
    else:  # SequentialLR
        if nested:
            _refuse("SequentialLR of SequentialLR: psd runs a SequentialLR of StepLR, MultiStepLR, ExponentialLR, "
                    "ConstantLR, LinearLR, CosineAnnealingLR, OneCycleLR")
        subs = list(s._schedulers)
        parts = [_sched_text(x, opt, True) for x in subs]
        base = parts[0][1]
        for x, (_, b, _) in zip(subs, parts):
            if any(not math.isclose(u, v, rel_tol=1e-12) for u, v in zip(b, base)):
                _refuse("SequentialLR: its %s starts from other learning rates than its %s (%s, %s): psd runs "
                        "one optimizer.lr", _cls(x), _cls(subs[0]), b, base)
        floor = any(p[2] for p in parts)
        text = "SequentialLR(schedulers=[%s], milestones=[%s])" % (
            ", ".join(p[0] for p in parts), ", ".join(_num(m) for m in s._milestones))
    if base is None:
        base = [g.get("initial_lr", g["lr"]) for g in groups]
    return text, [_f(b) for b in base], floor


# -- the offer ------------------------------------------------------------------------------------

def _entries(names, of, klass):
    """optimizer.groups matches for the tensors of class klass: "*.S" where every
    tensor named *.S is of it, else each tensor's own name."""
    mine = [n for n in names if of[n] == klass]
    by_last = collections.OrderedDict()
    for n in names:
        if "." in n:
            by_last.setdefault(n.rsplit(".", 1)[1], []).append(n)
    out, done = [], set()
    for n in mine:
        if n in done:
            continue
        if "." in n:
            last = n.rsplit(".", 1)[1]
            every = by_last[last]
            if all(of[x] == klass for x in every):
                out.append("*." + _escape(last))
                done.update(every)
                continue
        out.append(_escape(n))
        done.add(n)
    return out


def offer_text(named_params, optimizer=None, scheduler=None, interval="epoch", clip_norm=None):
    """The YAML psd.torch offers psd for the torch optimizer and scheduler
    (None: nothing to offer). named_params: the model's named_parameters()
    (the run's tensor names). interval: "epoch" when the loop steps the
    scheduler once an epoch, "step" once a batch. clip_norm: global-norm
    clipping of the reduced gradient (torch.nn.utils.clip_grad_norm_).
    Raises Unsupported with a one-line message for what psd does not run."""
    if interval not in ("epoch", "step"):
        _refuse("scheduler_interval=%r: \"epoch\" (the loop steps the scheduler once an epoch) or \"step\" "
                "(once a batch)", interval)
    if clip_norm is not None:
        if isinstance(clip_norm, bool) or _f(clip_norm) <= 0:
            _refuse("clip_norm=%r: a global gradient norm > 0, or None", clip_norm)
    if optimizer is None:
        if scheduler is not None:
            _refuse("scheduler= without optimizer=: give the optimizer the scheduler steps")
        return None if clip_norm is None else "optimizer: {clip_norm: %s}\n" % repr(_f(clip_norm))

    name, shared = _optimizer_kind(optimizer)
    groups = optimizer.param_groups
    params = list(named_params)
    names = [n for n, _ in params]
    by_id = {id(p): n for n, p in params}
    of = {}   # tensor name -> its group
    for k, g in enumerate(groups):
        _check_group(optimizer, name, g, k)
        for p in g["params"]:
            n = by_id.get(id(p))
            if n is None:
                _refuse("%s group %d holds a tensor (shape %s) that is not a parameter of the model: psd steps the "
                        "model's parameters only", _cls(optimizer), k, tuple(p.shape))
            of[n] = k
    for n in names:
        if n not in of:
            _refuse("the model's parameter %s is in no group of the %s: psd steps every parameter",
                    n, _cls(optimizer))
    run = {}
    for key, tkey, idx in shared:
        vals = [_run_value(g, tkey, idx) for g in groups]
        for k, v in enumerate(vals):
            if v != vals[0]:
                _refuse("%s: group %d has %s %r, group 0 %r: psd runs one %s for every tensor (per group: lr and "
                        "weight_decay)", _cls(optimizer), k, key, v, vals[0], key)
        run[key] = vals[0]

    sched_text, floor = None, False
    if scheduler is not None:
        sched_text, lrs, floor = _sched_text(scheduler, optimizer, False)
    else:
        lrs = [_f(g["lr"]) for g in groups]
    wds = [_f(g.get("weight_decay", 0)) for g in groups]
    for k, lr in enumerate(lrs):
        if lr <= 0:
            _refuse("%s group %d has lr %r: psd steps with a learning rate > 0", _cls(optimizer), k, lr)

    # groups of equal settings are one class; the class of the most tensors is the default
    klass = {}
    for k in range(len(groups)):
        klass.setdefault((lrs[k], wds[k]), k)
    of = {n: klass[(lrs[k], wds[k])] for n, k in of.items()}
    count = collections.Counter(of.values())
    default = max(sorted(count), key=lambda c: count[c])
    lr, wd = lrs[default], wds[default]
    if floor and any(x != lr for x in lrs):
        _refuse("CosineAnnealingLR with eta_min > 0 while the groups' learning rates differ: psd's eta_min is "
                "one learning rate for every group")
    entries = []
    for c in sorted(set(of.values())):
        if c == default:
            continue
        for m in _entries(names, of, c):
            entries.append("{match: %s, weight_decay: %s, lr_scale: %s}" % (_qs(m), repr(wds[c]), repr(lrs[c] / lr)))
    if len(entries) > MAX_GROUPS:
        _refuse("the %s's groups need %d optimizer.groups entries (by tensor name), more than psd's %d",
                _cls(optimizer), len(entries), MAX_GROUPS)

    keys = [("name", name), ("lr", repr(lr))]
    if name == "sgd":
        keys += [("momentum", repr(run["momentum"])), ("nesterov", "true" if run["nesterov"] else "false")]
    elif name in ("adam", "adamw"):
        keys += [("beta1", repr(run["beta1"])), ("beta2", repr(run["beta2"])), ("eps", repr(run["eps"]))]
    else:
        keys += [("eps", repr(run["eps"]))]
    keys.append(("weight_decay", repr(wd)))
    if clip_norm is not None:
        keys.append(("clip_norm", repr(_f(clip_norm))))
    if entries:
        keys.append(("groups", "[%s]" % ", ".join(entries)))
    text = "optimizer: {%s}\n" % ", ".join("%s: %s" % kv for kv in keys)
    if sched_text is not None:
        text += "schedule: {name: torch, torch: %s, interval: %s}\n" % (_qs(sched_text), interval)
    if len(text.encode()) > MAX_TEXT:
        _refuse("the optimizer's offer is %d bytes of YAML, more than psd's %d (groups by tensor name: group "
                "them by the names' last part)", len(text.encode()), MAX_TEXT)
    return text
