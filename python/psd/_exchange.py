"""A torch worker's exchange with psd: the gradients out, the weights in.

Exchange turns the parameters' gradients into the worker library's push descriptor
(psw_push_t) and a reply's weights (psw_event_t) into the parameters, and nothing else:
it never calls the library, so it is tested alone on plain buffers
(python/tests/test_exchange.py). On psd's host each parameter's .grad is a view of psd's
shared-memory push region (backward adds into it in place; the descriptor over those views
is built once and sent as it is); elsewhere, or when a gradient is not that view (a
zero_grad(set_to_none=True), an Embedding's sparse rows, parameters staged through host
buffers), the descriptor is built from the gradients of the batch. A reply's tensors are
viewed where the library has them (psd's few parameter slots: each view made once) and
copied into the parameters. Owned by psd.torch.Worker, which sends what this builds.
"""
import ctypes
import sys

import torch

from . import _lib as L
from ._staging import Staging


def view16(addr, n):
    """n bfloat16s at address addr as a 1-d tensor, no copy."""
    return torch.frombuffer((ctypes.c_uint16 * n).from_address(addr), dtype=torch.bfloat16)


def view(ptr, n):
    """n float32s at ptr (a ctypes float pointer) as a 1-d tensor, no copy (none: an empty one)."""
    addr = ctypes.cast(ptr, ctypes.c_void_p).value
    if n == 0 or not addr:
        return torch.empty(0)
    return torch.frombuffer((ctypes.c_float * n).from_address(addr), dtype=torch.float32)


class Exchange:
    """The gradients of a table of parameters as pushes, a reply's weights into them.

    table: [(name, parameter)] in psd's tensor order; sparse: the names whose gradients may go
    as rows (Embedding/EmbeddingBag(sparse=True)). bytes_pushed, rows_pushed, copies (batches
    whose gradients were not psd's views and were copied into its memory) and layer_pushes
    (tensors pushed on their own during backward) count what went."""

    def __init__(self, sparse=(), rank=lambda: 0):
        self.sparse = set(sparse)
        self._rank = rank        # for the messages: the worker's rank now
        self.table = None
        self.offsets = None
        self.region = None       # psd's push region (its host, shared memory), or None
        self.rows_ok = False     # the run takes sparse gradients as rows
        self.stg = None          # Staging (parameters on a device, or staging=True)
        self.early_sent = set()  # tensors of this batch pushed during backward
        self.bytes_pushed = 0
        self.rows_pushed = 0
        self.copies = 0
        self.layer_pushes = 0
        self._zeros = {}
        self._views = None       # each parameter's view of the push region
        self._flat = None        # the push region as one tensor
        self._fast = None        # the push descriptor over those views
        self._fast_grads = None  # (kept alive with it)
        self._fast_bytes = 0
        self._rviews = {}        # tensors over the reply buffers, by (tensor, address, numel)
        self._versions = None    # the parameters' _version once the weights came
        self._densified = False
        self._warned_copy = False

    def attach(self, table, offsets, region, rows_ok, staged, wire16=(False, False)):
        """A session's layout: the table, psd's offsets of each tensor, its push region (an
        address, or None), whether it takes rows; staged: through host buffers; wire16: the
        run's gradients, weights go as bfloat16 (staged: converted on the device)."""
        self.table = table
        self.offsets = offsets
        self.rows_ok = rows_ok
        self.region = None if staged else region
        if self.stg is not None and (self.stg.g16, self.stg.w16) != tuple(wire16):  # another run's wire
            self.stg.close()
            self.stg = None
        if staged and self.stg is None:
            self.stg = Staging(table, offsets, *wire16)

    def detach(self):
        """The session ends (its push region is unmapped with its client): no .grad may point
        there now; another session's buffers come at other addresses."""
        if self._views is not None:
            for (name, p), v in zip(self.table, self._views):
                if p.grad is not None and p.grad.data_ptr() == v.data_ptr():
                    p.grad = None
            self._views = None
            self._flat = None
            self._fast = None
        self._rviews.clear()
        self._versions = None

    def close(self):
        self.detach()
        if self.stg is not None:
            self.stg.close()
            self.stg = None

    # -- before a batch, and the weights ----------------------------------------------------

    def begin(self):
        """Before a batch: the gradients zeroed; on psd's host each .grad a view of psd's push
        region (the push copies nothing)."""
        if self.stg is not None:
            self.stg.begin()
            self.early_sent = set()
            return
        with torch.no_grad():
            if self.region:
                if self._views is None:
                    n = max(int(o) + p.numel() for o, (_, p) in zip(self.offsets, self.table))
                    self._flat = view(ctypes.cast(self.region, L.c_float_p), n)
                    self._views = [self._flat[int(o):int(o) + p.numel()].view(p.shape)
                                   for o, (_, p) in zip(self.offsets, self.table)]
                    self._fast = self._fast_descriptor()
                self._flat.zero_()  # every gradient at once (and the gaps psd leaves between them)
                for (name, p), v in zip(self.table, self._views):
                    if p.grad is not v:
                        p.grad = v
            else:
                for name, p in self.table:
                    if p.grad is not None and p.grad.is_sparse:
                        p.grad = None  # backward makes the next batch's
                    elif p.grad is not None:
                        p.grad.zero_()

    def load(self, ev, w16=None):
        """A reply's (WEIGHTS, VALIDATE) tensors into the parameters; with row ids, only those
        rows of the sparse tables. w16: the address of the reply's weights as bfloat16 came
        (staged with bfloat16 weights: widened on the device)."""
        if self.stg is not None:
            if self.stg.w16 and w16:
                srcs = self._rviews.get(("bf16", w16))  # the library's buffer: one address a registration
                if srcs is None:
                    flat = view16(w16, self.stg.weights.numel())
                    srcs = self._rviews[("bf16", w16)] = [flat[int(o):int(o) + p.numel()].view(p.shape)
                                                           for o, (_, p) in zip(self.offsets, self.table)]
            else:
                srcs = [view(ev.tensors[k], ev.tensor_numel[k]).view(p.shape) for k, (_, p) in enumerate(self.table)]
            self.stg.load(srcs)
        else:
            with torch.no_grad():
                rows = None
                if ev.n_row_ids:  # the reply to a push with want: only those rows of the table are new
                    rows = torch.frombuffer((ctypes.c_uint32 * ev.n_row_ids).from_address(
                        ctypes.cast(ev.row_ids, ctypes.c_void_p).value), dtype=torch.int32).long()
                for k, (name, p) in enumerate(self.table):
                    src = self._reply_view(k, ev.tensors[k], ev.tensor_numel[k], p.shape)
                    if rows is not None and name in self.sparse:
                        p.data.index_copy_(0, rows, src.index_select(0, rows))
                    else:
                        p.data.copy_(src)
        self._versions = [p._version for _, p in self.table]

    def changed(self):
        """The name of a parameter changed in place since the weights came (a torch
        optimizer's step), or None."""
        if self._versions is not None:
            for (name, p), v in zip(self.table, self._versions):
                if p._version != v:
                    return name
        return None

    def _reply_view(self, k, ptr, n, shape):
        """Tensor k of a reply over the library's buffer: made once for each address a reply
        brings it at (psd's few parameter slots, or the client's buffer), then reused."""
        addr = ctypes.cast(ptr, ctypes.c_void_p).value
        key = (k, addr, n)
        v = self._rviews.get(key)
        if v is None:
            if len(self._rviews) > 16 * len(self.table):  # addresses of another session: start again
                self._rviews.clear()
            v = self._rviews[key] = view(ptr, n).view(shape)
        return v

    # -- the push ---------------------------------------------------------------------------

    def push(self, version, batch, loss_sum, correct, last, want=None):
        """The push of this batch's gradients: (psw_push_t, what it points into, to be kept
        until it is sent). last: no pull of the next weights (the epoch's last batch);
        want(): the table rows the next batch reads (int32 tensor), asked for only where rows
        are pushed and a next batch comes."""
        fast = self._fast
        if fast is not None and self.stg is None and all(p.grad is v for (_, p), v in zip(self.table, self._views)):
            fast.version, fast.batch, fast.loss_sum, fast.correct = version, batch, float(loss_sum), int(correct)
            fast.pull = 0 if last else 1
            self.bytes_pushed += self._fast_bytes
            return fast, None
        grads, keep, n_grads, n_rows = self._grads()
        self.rows_pushed += n_rows
        push = L.Push(version=version, batch=batch, loss_sum=float(loss_sum), correct=int(correct),
                      pull=0 if last else 1, n_grads=n_grads, grads=grads)
        if n_rows and not last and want is not None:  # the reply brings only the rows the next batch reads
            ids = want()
            if ids is not None and ids.numel():
                keep.append(ids)
                push.want = ctypes.cast(ids.data_ptr(), L.c_u32_p)
                push.n_want = ids.numel()
        keep.append(grads)
        return push, keep

    def _grads(self):
        """Each gradient's descriptor, from the tensors themselves: (grads, keep, n, rows)."""
        table = self.table
        grads = (L.Grad * len(table))()
        keep = []
        copied = False
        n_rows = 0
        n = 0
        if self.stg is not None:
            self.stg.finish()
        for k, (name, p) in enumerate(table):
            if self.stg is not None:  # from the host buffer (the tensors pushed during backward aside)
                if k in self.early_sent:
                    continue
                g = self.stg.gviews[k]  # float32, or bfloat16 already (the library sends it as it is)
                grads[n].tensor = k
                grads[n].data = ctypes.cast(g.data_ptr(), L.c_float_p)
                n += 1
                self.bytes_pushed += g.element_size() * g.numel()
                continue
            g = p.grad
            if g is not None and g.is_sparse and g.dtype == torch.float32 and g.device.type == "cpu":
                g = g.coalesce()
                if g._nnz() > 0 and name in self.sparse and self.rows_ok:  # as rows: ids, then their values
                    ids = g.indices()[0].to(torch.int32).contiguous()
                    vals = g.values().contiguous()
                    keep += [ids, vals]
                    grads[n].tensor = k
                    grads[n].row_ids = ctypes.cast(ids.data_ptr(), L.c_u32_p)
                    grads[n].n_rows = ids.numel()
                    grads[n].row_vals = ctypes.cast(vals.data_ptr(), L.c_float_p)
                    n += 1
                    n_rows += ids.numel()
                    self.bytes_pushed += 4 * ids.numel() + 4 * vals.numel()
                    continue
                if g._nnz() > 0 and not self._densified:
                    self._densified = True
                    print("psd: worker %d: the sparse gradient of %s goes whole: %s" % (
                        self._rank(), name, "its parameter is not an Embedding(sparse=True)"
                        if name not in self.sparse else "this run cannot take rows (psd shards whose pieces are "
                        "not whole rows, or bfloat16 gradients)"), file=sys.stderr, flush=True)
                g = g.to_dense()
            if g is None:  # not used in this forward: a zero gradient
                g = self._zeros.get(k)
                if g is None:
                    g = self._zeros[k] = torch.zeros_like(p)
            elif g.dtype != torch.float32 or g.device.type != "cpu" or g.is_sparse:
                raise ValueError("psd: the gradient of %s is %s%s on %s: float32 dense CPU gradients only" %
                                 (name, g.dtype, " sparse" if g.is_sparse else "", g.device))
            elif not g.is_contiguous():
                g = g.contiguous()
            if self._views is not None and p.grad is not None and g.data_ptr() != self._views[k].data_ptr():
                copied = True
            keep.append(g)
            grads[n].tensor = k
            grads[n].data = ctypes.cast(g.data_ptr(), L.c_float_p)
            n += 1
            self.bytes_pushed += 4 * g.numel()
        if copied:
            self.copies += 1
            if not self._warned_copy:
                self._warned_copy = True
                print("psd: worker %d: the gradients are not in psd's shared memory (model.zero_grad() with "
                      "set_to_none=True dropped them?): each step copies them there; psd zeroes the gradients "
                      "before each batch, so the zero_grad() call can go" % self._rank(), file=sys.stderr,
                      flush=True)
        return grads, keep, n, n_rows

    def _fast_descriptor(self):
        """The push of every gradient from its shared-memory view, or None where a gradient goes
        another way (rows of a sparse table)."""
        if self.sparse:
            return None
        grads = (L.Grad * len(self.table))()
        for k, v in enumerate(self._views):
            grads[k].tensor = k
            grads[k].data = ctypes.cast(v.data_ptr(), L.c_float_p)
        self._fast_bytes = 4 * sum(v.numel() for v in self._views)
        self._fast_grads = grads
        return L.Push(n_grads=len(self.table), grads=grads)

    def backward(self, loss, version, batch, loss_sum, correct, send):
        """loss.backward() with staged parameters: each layer's gradient, once in host memory,
        pushed on its own with send(push) -> rc while backward goes on with the layers below;
        the newest waits for the batch's push (push())."""
        push = L.Push(version=version, batch=batch, loss_sum=float(loss_sum), correct=int(correct), pull=0,
                      n_grads=1)
        pending = []
        stg = self.stg

        def ready(k):
            pending.append(k)
            while len(pending) > 1 and stg.ready(pending[0]):
                j = pending.pop(0)
                stg.wait(j)
                g = L.Grad(tensor=j, data=ctypes.cast(stg.gviews[j].data_ptr(), L.c_float_p))
                push.grads = ctypes.pointer(g)
                send(push)
                self.early_sent.add(j)
                self.layer_pushes += 1
                self.bytes_pushed += stg.gviews[j].element_size() * stg.gviews[j].numel()

        stg.on_ready = ready
        try:
            loss.backward()
        finally:
            stg.on_ready = None
