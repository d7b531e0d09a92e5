"""A small DCRNN (Li et al. 2018, "Diffusion Convolutional Recurrent Neural Network") forecasting
traffic speed on a synthetic road-sensor graph, as a LightningDataModule and a LightningModule.

Nothing here knows about psd: fit.py trains it with Lightning alone or through psd.lightning.

    data = TrafficData(batch_size=64)
    model = DCRNN(data.supports, data.std)
    lightning.Trainer(max_epochs=5).fit(model, data)

The data (no downloads): 207 sensors (as METR-LA) at random points of the unit square, each
linked to its 8 nearest neighbours with a Gaussian kernel of the distance as weight (DCRNN's
construction). Speeds every 5 minutes for 10 days: a free-flow speed per sensor, a morning and an
evening rush, and incidents whose congestion spreads upstream along the graph's edges, one hop
every LAG steps, so that a sensor's neighbours announce its next minutes.
"""
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl

STEPS_PER_DAY = 288  # 5-minute steps
LAG = 2  # steps a congestion wave takes to cross one edge upstream


def road_graph(nodes=207, neighbours=8, seed=0):
    """Sensors at random points, each pointing to its nearest neighbours (traffic flows i -> j).
    Returns the weights W (nodes, nodes): W[i, j] = exp(-(d_ij / sigma)^2), 0 below 0.1 and off
    the k-nearest, sigma the neighbours' mean distance."""
    rng = np.random.default_rng(seed)
    xy = rng.uniform(0, 1, (nodes, 2))
    d = np.linalg.norm(xy[:, None] - xy[None], axis=-1)  # (N, N)
    np.fill_diagonal(d, np.inf)
    near = np.argsort(d, axis=1)[:, :neighbours]  # (N, k)
    rows = np.repeat(np.arange(nodes), neighbours)
    dist = d[rows, near.ravel()]
    w = np.zeros((nodes, nodes))
    w[rows, near.ravel()] = np.exp(-((dist / dist.mean()) ** 2))
    w[w < 0.1] = 0
    return w


def transitions(w):
    """The forward and backward random walks of DCRNN: D_out^-1 W and D_in^-1 W^T, (N, N)."""
    fwd = w / np.maximum(w.sum(1, keepdims=True), 1e-12)
    bwd = w.T / np.maximum(w.T.sum(1, keepdims=True), 1e-12)
    return fwd, bwd


def rush(step):
    """Traffic demand by time of day, 0 to about 1: peaks at 8:00 and 17:30."""
    h = (step % STEPS_PER_DAY) / 12.0
    return np.exp(-(((h - 8.0) / 1.2) ** 2)) + 0.8 * np.exp(-(((h - 17.5) / 1.5) ** 2))


def speeds(w, days=10, seed=0):
    """Speed of every sensor (mph), (days * 288, N) float32.

    Congestion c >= 0 per sensor: an incident (more likely at rush hour) adds to its own sensor
    for 30 minutes to 2.5 hours and decays after; a sensor is at least as congested as 0.8 x the
    edge weight x its downstream neighbours' congestion LAG steps ago (a queue backing up)."""
    rng = np.random.default_rng(seed + 1)
    n, steps = len(w), days * STEPS_PER_DAY
    free = rng.uniform(55, 70, n)  # mph
    peak_drop = rng.uniform(0.05, 0.3, n)  # share of free-flow speed lost at rush hour
    c = np.zeros((steps, n))
    left = np.zeros(n, dtype=int)  # steps of the current incident left
    size = np.zeros(n)
    for t in range(1, steps):
        start = (left == 0) & (rng.random(n) < 0.001 * (1 + 3 * rush(t)))
        left[start] = rng.integers(6, 30, start.sum())
        size[start] = rng.uniform(0.3, 0.8, start.sum())
        own = 0.8 * c[t - 1] + size * (left > 0)
        left = np.maximum(left - 1, 0)
        queue = (0.8 * w * c[max(t - LAG, 0)][None, :]).max(1)  # from downstream j to i
        c[t] = np.maximum(own, queue)
    tod = np.arange(steps)
    v = free * (1 - peak_drop * rush(tod)[:, None]) * (1 - 0.6 * np.tanh(c))
    v += rng.normal(0, 2.0, v.shape)
    return np.clip(v, 3, 80).astype(np.float32)


class Windows(Dataset):
    """(x, y) pairs from a stretch of the series: x (t_in, N, 2) the past speeds (standardised)
    and the time of day (0 to 1); y (t_out, N) the next speeds (standardised)."""

    def __init__(self, z, tod, t_in, t_out):
        self.z, self.tod, self.t_in, self.t_out = z, tod, t_in, t_out

    def __len__(self):
        return len(self.z) - self.t_in - self.t_out + 1

    def __getitem__(self, i):
        past = slice(i, i + self.t_in)
        x = torch.stack([self.z[past], self.tod[past, None].expand(-1, self.z.shape[1])], -1)
        return x, self.z[i + self.t_in:i + self.t_in + self.t_out]


class TrafficData(pl.LightningDataModule):
    """The graph and the series, split by time into 70% train, 10% val, 20% test (windows do not
    cross the splits), standardised with the training part's mean and std. Everything is made
    here, from the seed, rather than in setup(): the model needs the graph and the scale before
    the Trainer starts, and every process (DDP rank, psd worker) makes the same data."""

    def __init__(self, batch_size=64, nodes=207, days=10, t_in=12, t_out=3, seed=0):
        super().__init__()
        self.batch_size, self.t_in, self.t_out, self.seed = batch_size, t_in, t_out, seed
        self.w = road_graph(nodes, seed=seed)
        self.supports = [torch.from_numpy(p.astype(np.float32)) for p in transitions(self.w)]
        self.v = speeds(self.w, days, seed)  # (T, N) mph
        cut = [int(len(self.v) * f) for f in (0.7, 0.8)]
        self.mean, self.std = float(self.v[:cut[0]].mean()), float(self.v[:cut[0]].std())
        z = torch.from_numpy((self.v - self.mean) / self.std)
        tod = torch.from_numpy((np.arange(len(self.v)) % STEPS_PER_DAY / STEPS_PER_DAY).astype(np.float32))
        parts = zip([0] + cut, cut + [len(self.v)])
        self.train, self.val, self.test = (Windows(z[a:b], tod[a:b], t_in, t_out) for a, b in parts)
        self.cut = cut

    def _loader(self, ds, shuffle):
        # the order: torch's global generator (seed_everything); DDP and psd put their own sampler
        return DataLoader(ds, batch_size=self.batch_size, shuffle=shuffle)

    def train_dataloader(self):
        return self._loader(self.train, True)

    def val_dataloader(self):
        return self._loader(self.val, False)

    def test_dataloader(self):
        return self._loader(self.test, False)

    def baselines(self):
        """Validation MAE (mph) of two models that use no graph: the historical average (each
        sensor's mean speed at that time of day over the training days, DCRNN's "HA") and the
        last value seen, over every predicted step of the validation windows."""
        tr, steps = self.v[:self.cut[0]], np.arange(self.cut[0]) % STEPS_PER_DAY
        ha = np.stack([tr[steps == s].mean(0) for s in range(STEPS_PER_DAY)])  # (288, N)
        a, b = self.cut
        err_ha, err_last = [], []
        for i in range(a, b - self.t_in - self.t_out + 1):
            y = self.v[i + self.t_in:i + self.t_in + self.t_out]  # (t_out, N)
            tgt = np.arange(i + self.t_in, i + self.t_in + self.t_out) % STEPS_PER_DAY
            err_ha.append(np.abs(ha[tgt] - y).mean())
            err_last.append(np.abs(self.v[i + self.t_in - 1] - y).mean())
        return {"historical_average": float(np.mean(err_ha)), "last_value": float(np.mean(err_last))}


class DiffusionConv(torch.nn.Module):
    """DCRNN's diffusion convolution: out = sum_k (P_f^k X Theta_fk + P_b^k X Theta_bk), k = 0..K
    (k = 0 once), as one Linear over the stacked diffusions. hops=0: a per-node Linear, no graph.
    Tensors are nodes first, (N, B, F), so that a hop is one sparse (N, N) x (N, B*F) product."""

    def __init__(self, in_dim, out_dim, hops, walks=2):
        super().__init__()
        self.hops = hops
        self.lin = torch.nn.Linear(in_dim * (1 + walks * hops), out_dim)

    def forward(self, x, supports):  # x (N, B, F), supports: sparse (N, N) walks -> (N, B, out)
        n, b, f = x.shape
        x0 = x.reshape(n, b * f)
        terms = [x0]
        for p in supports:
            xk = x0
            for _ in range(self.hops):
                xk = torch.sparse.mm(p, xk)
                terms.append(xk)
        return self.lin(torch.stack(terms, -1).reshape(n, b, -1))  # features (F, M) flattened


class DCGRUCell(torch.nn.Module):
    """A GRU whose matrix products are diffusion convolutions over the graph."""

    def __init__(self, in_dim, hidden, hops):
        super().__init__()
        self.gates = DiffusionConv(in_dim + hidden, 2 * hidden, hops)
        self.cand = DiffusionConv(in_dim + hidden, hidden, hops)

    def forward(self, x, h, supports):  # x (N, B, in), h (N, B, hidden)
        r, u = torch.sigmoid(self.gates(torch.cat([x, h], -1), supports)).chunk(2, -1)
        c = torch.tanh(self.cand(torch.cat([x, r * h], -1), supports))
        return u * h + (1 - u) * c


class DCRNN(pl.LightningModule):
    """Encoder-decoder of DCGRU cells: the encoder reads t_in steps of (speed, time of day), the
    decoder starts from zeros and feeds back its own predictions for t_out steps.

    supports: the forward and backward transition matrices, dense (N, N) float32 (non-persistent
    buffers, dense as DDP broadcasts buffers and has no sparse ones: they are data, made from the
    seed, never trained, not in checkpoints; made sparse in forward()); std: the
    speeds' standard deviation (mph), to report errors in mph."""

    def __init__(self, supports, std, hidden=16, layers=1, hops=2, t_out=3, lr=1e-2, milestones=()):
        super().__init__()
        self.save_hyperparameters(ignore=["supports"])
        self.register_buffer("fwd", supports[0], persistent=False)
        self.register_buffer("bwd", supports[1], persistent=False)
        self.encoder = torch.nn.ModuleList([DCGRUCell(2 if i == 0 else hidden, hidden, hops) for i in range(layers)])
        self.decoder = torch.nn.ModuleList([DCGRUCell(1 if i == 0 else hidden, hidden, hops) for i in range(layers)])
        self.proj = torch.nn.Linear(hidden, 1)

    def forward(self, x):  # x (B, t_in, N, 2) -> (B, t_out, N), standardised speeds
        b, t_in, n, _ = x.shape
        x = x.permute(1, 2, 0, 3)  # (t_in, N, B, 2): nodes first
        sup = [self.fwd.to_sparse(), self.bwd.to_sparse()]  # about 7 entries a row
        h = [x.new_zeros(n, b, self.hparams.hidden) for _ in self.encoder]
        for t in range(t_in):
            inp = x[t]
            for i, cell in enumerate(self.encoder):
                h[i] = inp = cell(inp, h[i], sup)
        out, inp = [], x.new_zeros(n, b, 1)  # DCRNN's "GO" symbol
        for _ in range(self.hparams.t_out):
            for i, cell in enumerate(self.decoder):
                h[i] = cell(inp if i == 0 else h[i - 1], h[i], sup)
            inp = self.proj(h[-1])
            out.append(inp[..., 0].t())
        return torch.stack(out, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.l1_loss(self(x), y)  # MAE in standard deviations, DCRNN's loss
        self.log("train_loss", loss, batch_size=len(x))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        err = self(x) - y
        loss = err.abs().mean()
        n, s = len(x), self.hparams.std
        self.log("val_loss", loss, batch_size=n, sync_dist=True)
        self.log("val_mae", loss * s, batch_size=n, sync_dist=True)  # mph
        # the mean squared error (mph^2): RMSE is its square root, not a mean of batches' RMSEs
        self.log("val_mse", (err * s).pow(2).mean(), batch_size=n, sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        if not self.hparams.milestones:
            return opt
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, list(self.hparams.milestones), gamma=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}
