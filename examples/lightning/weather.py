"""A graph weather forecaster, small: encode-process-decode on a mesh over a lat-lon grid (the
shape of GraphCast), forecasting a synthetic advection-diffusion field one step ahead. A
LightningModule and a LightningDataModule; no psd in it (fit.py --model weather trains it
alone or through psd).

The field: a tracer on a 12 x 24 lat-lon grid, carried by a zonal jet and a meridional wave and
diffused, stepped with finite differences (periodic in longitude, closed at the poles) from
random smooth starts; a sample is (the field at t, the field at t + 1). The mesh: a coarser 6 x 12
lat-lon grid of nodes, each joined to its 8 neighbours; each grid point sends to (encoder) and
receives from (decoder) its 3 nearest mesh nodes by great-circle distance; a grid point's input
is its value and the differences to its 4 neighbours (without them the network sits on the
"no change" forecast for hundreds of steps before it finds the flow). Nothing is downloaded.
"""
import math

import torch
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl


def latlon(n_lat, n_lon):
    """Cell-centre latitudes and longitudes (radians) of an n_lat x n_lon grid, flattened."""
    lat = (torch.arange(n_lat, dtype=torch.float64) + 0.5) / n_lat * math.pi - math.pi / 2
    lon = (torch.arange(n_lon, dtype=torch.float64) + 0.5) / n_lon * 2 * math.pi
    la, lo = torch.meshgrid(lat, lon, indexing="ij")
    return la.reshape(-1), lo.reshape(-1)


def advect_diffuse(u, lat, dlat, dlon, dt, kappa, t):
    """One explicit step of du/dt = -a du/dx - b du/dy + kappa lap(u) on the grid (u: (T, n_lat,
    n_lon)); a: a zonal jet, b: a meridional wave drifting east; upwind advection."""
    n_lat, n_lon = u.shape[-2:]
    coslat = torch.cos(lat).clamp(min=0.2).view(-1, 1)
    lon = torch.arange(n_lon, dtype=u.dtype) / n_lon * 2 * math.pi
    a = (1.0 + 0.5 * torch.cos(2 * lat)).view(-1, 1)                          # zonal wind
    b = 0.3 * torch.sin(2 * lon.view(1, -1) - 0.05 * t) * coslat              # meridional wind
    # upwind differences (stable while a wind crosses less than a cell a step)
    ux = torch.where(a > 0, u - torch.roll(u, 1, -1), torch.roll(u, -1, -1) - u) / (dlon * coslat)
    up = torch.cat([u[..., 1:, :], u[..., -1:, :]], -2)   # closed poles: zero gradient
    dn = torch.cat([u[..., :1, :], u[..., :-1, :]], -2)
    uy = torch.where(b > 0, u - dn, up - u) / dlat
    lap = (torch.roll(u, -1, -1) + torch.roll(u, 1, -1) - 2 * u) / (dlon * coslat) ** 2 + (up + dn - 2 * u) / dlat ** 2
    return u + dt * (-a * ux - b * uy + kappa * lap)


def trajectories(n, frames, n_lat=12, n_lon=24, substeps=8, seed=0):
    """n trajectories of `frames` fields (n, frames, n_lat, n_lon), float32."""
    g = torch.Generator().manual_seed(seed)
    lat, lon = latlon(n_lat, n_lon)
    lat, lon = lat.view(n_lat, n_lon), lon.view(n_lat, n_lon)
    u = torch.zeros(n, n_lat, n_lon, dtype=torch.float64)
    for _ in range(6):  # smooth random starts: Gaussian blobs
        c_lat = (torch.rand(n, 1, 1, generator=g, dtype=torch.float64) - 0.5) * 2.4
        c_lon = torch.rand(n, 1, 1, generator=g, dtype=torch.float64) * 2 * math.pi
        amp = torch.randn(n, 1, 1, generator=g, dtype=torch.float64)
        d = torch.sin(lat) * torch.sin(c_lat) + torch.cos(lat) * torch.cos(c_lat) * torch.cos(lon - c_lon)
        u += amp * torch.exp((d.clamp(-1, 1) - 1) / 0.4)
    dlat, dlon = math.pi / n_lat, 2 * math.pi / n_lon
    out = [u]
    for f in range(1, frames):
        for s in range(substeps):
            u = advect_diffuse(u, lat[:, 0], dlat, dlon, 0.02, 0.01, f * substeps + s)
        out.append(u)
    return torch.stack(out, 1).float()


class Pairs(Dataset):
    """(the field at t, the field at t + 1), each (n_lat * n_lon,), from trajectories (n, frames, ...)."""

    def __init__(self, traj):
        self.x = traj.reshape(traj.shape[0], traj.shape[1], -1)
        self.per = traj.shape[1] - 1

    def __len__(self):
        return self.x.shape[0] * self.per

    def __getitem__(self, i):
        k, t = divmod(i, self.per)
        return self.x[k, t], self.x[k, t + 1]


class WeatherData(pl.LightningDataModule):
    """40 trajectories to train on, 8 to validate on, 24 frames each: 920 and 184 pairs."""

    def __init__(self, batch_size=16, train=40, val=8, frames=24, seed=0):
        super().__init__()
        self.batch_size = batch_size
        traj = trajectories(train + val, frames, seed=seed)
        self.train, self.val = Pairs(traj[:train]), Pairs(traj[train:])
        self.scale = float(traj[:train, 1:].sub(traj[:train, :-1]).std())  # of a step's change

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size)

    def persistence_mae(self):
        """The forecast "no change" (the field at t for t + 1): its validation MAE."""
        x, y = self.val.x[:, :-1], self.val.x[:, 1:]
        return float((x - y).abs().mean())


def _mlp(i, h, o):
    return torch.nn.Sequential(torch.nn.Linear(i, h), torch.nn.SiLU(), torch.nn.Linear(h, o))


def _nearest(q_lat, q_lon, p_lat, p_lon, k):
    """For each query point the k nearest points p (great-circle), as (query, point) index pairs."""
    d = torch.sin(q_lat).view(-1, 1) * torch.sin(p_lat).view(1, -1) + torch.cos(q_lat).view(-1, 1) * \
        torch.cos(p_lat).view(1, -1) * torch.cos(q_lon.view(-1, 1) - p_lon.view(1, -1))
    idx = d.topk(k, dim=1).indices
    return torch.arange(q_lat.numel()).repeat_interleave(k), idx.reshape(-1)


def _edge_features(s_lat, s_lon, d_lat, d_lon):
    """(dlat, sin dlon, cos dlon, distance) of each edge, float32."""
    dl = d_lon - s_lon
    dist = torch.arccos((torch.sin(s_lat) * torch.sin(d_lat) + torch.cos(s_lat) * torch.cos(d_lat) *
                         torch.cos(dl)).clamp(-1, 1))
    return torch.stack([d_lat - s_lat, torch.sin(dl), torch.cos(dl), dist], 1).float()


class Interaction(torch.nn.Module):
    """Messages along edges (src -> dst) from both ends and the edge, summed into dst, added."""

    def __init__(self, h):
        super().__init__()
        self.edge = _mlp(3 * h, h, h)
        self.node = _mlp(2 * h, h, h)

    def forward(self, hs, hd, e, src, dst):  # hs (B, S, H), hd (B, D, H), e (E, H)
        m = self.edge(torch.cat([hs[:, src], hd[:, dst], e.expand(hs.shape[0], -1, -1)], -1))
        agg = torch.zeros_like(hd).index_add_(1, dst, m)
        return hd + self.node(torch.cat([hd, agg], -1))


class MeshForecaster(pl.LightningModule):
    """Encode (grid -> mesh), process (rounds on the mesh), decode (mesh -> grid): the next
    field as the present one plus the decoded change (in units of the data's step change)."""

    def __init__(self, scale, hidden=24, rounds=2, lr=3e-3, epochs=10, n_lat=12, n_lon=24, m_lat=6, m_lon=12, k=3):
        super().__init__()
        self.save_hyperparameters()
        self.scale, self.lr, self.epochs = scale, lr, epochs
        g_lat, g_lon = latlon(n_lat, n_lon)
        m_la, m_lo = latlon(m_lat, m_lon)
        gm_g, gm_m = _nearest(g_lat, g_lon, m_la, m_lo, k)  # grid point -> its k nearest mesh nodes
        ii, jj = torch.meshgrid(torch.arange(m_lat), torch.arange(m_lon), indexing="ij")
        src, dst = [], []
        for di in (-1, 0, 1):
            for dj in (-1, 0, 1):
                if di == dj == 0:
                    continue
                ok = ((ii + di) >= 0) & ((ii + di) < m_lat)
                n = (ii + di).clamp(0, m_lat - 1) * m_lon + (jj + dj) % m_lon
                src.append(n[ok])
                dst.append((ii * m_lon + jj)[ok])
        mm_s, mm_d = torch.cat(src), torch.cat(dst)
        for name, t in (("gm_g", gm_g), ("gm_m", gm_m), ("mm_s", mm_s), ("mm_d", mm_d)):
            self.register_buffer(name, t, persistent=False)
        self.register_buffer("g_static", torch.stack([torch.sin(g_lat), torch.cos(g_lat), torch.sin(g_lon),
                                                      torch.cos(g_lon)], 1).float(), persistent=False)
        self.register_buffer("m_static", torch.stack([torch.sin(m_la), torch.cos(m_la), torch.sin(m_lo),
                                                      torch.cos(m_lo)], 1).float(), persistent=False)
        self.register_buffer("e_gm", _edge_features(g_lat[gm_g], g_lon[gm_g], m_la[gm_m], m_lo[gm_m]),
                             persistent=False)
        self.register_buffer("e_mg", _edge_features(m_la[gm_m], m_lo[gm_m], g_lat[gm_g], g_lon[gm_g]),
                             persistent=False)
        self.register_buffer("e_mm", _edge_features(m_la[mm_s], m_lo[mm_s], m_la[mm_d], m_lo[mm_d]),
                             persistent=False)
        h = hidden
        self.n_lat, self.n_lon = n_lat, n_lon
        self.grid_in, self.mesh_in = _mlp(9, h, h), _mlp(4, h, h)
        self.edge_gm, self.edge_mg, self.edge_mm = _mlp(4, h, h), _mlp(4, h, h), _mlp(4, h, h)
        self.encode = Interaction(h)
        self.process = torch.nn.ModuleList(Interaction(h) for _ in range(rounds))
        self.decode = Interaction(h)
        self.out = torch.nn.Linear(h, 1)

    def stencil(self, u):
        """Each grid point's value and its differences to its 4 neighbours (B, n_grid, 5)."""
        g = u.view(-1, self.n_lat, self.n_lon)
        up = torch.cat([g[:, 1:], g[:, -1:]], 1)
        dn = torch.cat([g[:, :1], g[:, :-1]], 1)
        d = [torch.roll(g, -1, 2) - g, torch.roll(g, 1, 2) - g, up - g, dn - g]
        return torch.stack([g] + d, -1).view(u.shape[0], -1, 5)

    def forward(self, u):  # u (B, n_grid) -> the next field (B, n_grid)
        b = u.shape[0]
        hg = self.grid_in(torch.cat([self.stencil(u), self.g_static.expand(b, -1, -1)], -1))
        hm = self.mesh_in(self.m_static).expand(b, -1, -1)
        hm = self.encode(hg, hm, self.edge_gm(self.e_gm), self.gm_g, self.gm_m)
        e_mm = self.edge_mm(self.e_mm)
        for layer in self.process:
            hm = layer(hm, hm, e_mm, self.mm_s, self.mm_d)
        hg = self.decode(hm, hg, self.edge_mg(self.e_mg), self.gm_m, self.gm_g)
        return u + self.scale * self.out(hg).squeeze(-1)

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y) / self.scale ** 2
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, i):
        x, y = batch
        p = self(x)
        self.log("val_loss", torch.nn.functional.mse_loss(p, y) / self.scale ** 2)
        self.log("val_mae", (p - y).abs().mean())

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.epochs)}
