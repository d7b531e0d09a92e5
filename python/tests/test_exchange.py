"""psd.torch's exchange (psd/_exchange.py) alone: no psd, no library calls. The gradients as
push descriptors (over psd's shared-memory views, or the tensors of the batch: set_to_none,
unused parameters, sparse rows, staged layers pushed during backward) and a reply's weights
into the parameters (whole, or the rows asked for)."""
import ctypes

import torch

from psd import _lib as L
from psd._exchange import Exchange


def addr(t):
    return t.data_ptr()


def ptr(p):
    return ctypes.cast(p, ctypes.c_void_p).value


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 4)   # weight 12 floats, bias 4
        self.b = torch.nn.Linear(4, 2)   # an unused layer in some tests

    def forward(self, x):
        return self.a(x).sum()


def region_of(table, gap=4):
    """psd's push region as it lays it out (each tensor at an offset, gaps between), filled with 7."""
    offsets, o = [], 0
    for _, p in table:
        offsets.append(o)
        o += p.numel() + gap
    buf = (ctypes.c_float * o)(*([7.0] * o))
    return buf, offsets


def on_psds_host():
    """A Net, its table, psd's region and offsets, and an Exchange over them, begun."""
    torch.manual_seed(0)
    m = Net()
    table = list(m.named_parameters())
    buf, offs = region_of(table)
    ex = Exchange()
    ex.attach(table, offs, ctypes.addressof(buf), False, False)
    ex.begin()
    return m, table, buf, offs, ex


def test_on_psds_host_the_gradients_are_views_of_its_region_and_the_push_copies_nothing():
    m, table, buf, offs, ex = on_psds_host()
    end = offs[-1] + table[-1][1].numel()
    assert all(v == 0.0 for v in buf[:end]), "the region zeroed, the gaps between the tensors too"
    for k, (_, p) in enumerate(table):
        assert addr(p.grad) == ctypes.addressof(buf) + 4 * offs[k]
    m(torch.ones(2, 3)).backward()
    assert buf[0] == 2.0, "backward added into psd's memory"
    push, keep = ex.push(5, 32, 1.5, 3, last=False)
    assert keep is None and (push.version, push.batch, push.loss_sum, push.correct, push.pull) == (5, 32, 1.5, 3, 1)
    assert push.n_grads == 4
    assert [ptr(push.grads[k].data) for k in range(4)] == [ctypes.addressof(buf) + 4 * o for o in offs]
    again, _ = ex.push(6, 8, 0.0, 0, last=True)
    assert ctypes.addressof(again) == ctypes.addressof(push), "the descriptor is built once"
    assert again.pull == 0 and again.version == 6
    assert ex.bytes_pushed == 2 * 4 * sum(p.numel() for _, p in table) and ex.copies == 0
    ex.detach()
    assert all(p.grad is None for _, p in table), "no .grad points into an unmapped region"


def test_a_gradient_that_is_not_psds_view_is_pushed_from_the_tensor_and_counted_a_copy():
    m, table, buf, offs, ex = on_psds_host()
    m.zero_grad(set_to_none=True)
    m(torch.ones(2, 3)).backward()   # new gradients; b's stay None (unused)
    push, keep = ex.push(1, 2, 0.0, 0, last=False)
    assert ex.copies == 1
    got = {push.grads[k].tensor: ptr(push.grads[k].data) for k in range(push.n_grads)}
    assert got[0] == addr(m.a.weight.grad) and got[1] == addr(m.a.bias.grad)
    for k in (2, 3):  # unused: zeros of the parameter's size, not psd's memory
        z = (ctypes.c_float * table[k][1].numel()).from_address(got[k])
        assert list(z) == [0.0] * table[k][1].numel()
        assert got[k] != ctypes.addressof(buf) + 4 * offs[k]
    assert any(t is m.a.weight.grad for t in keep)


def test_sparse_gradients_go_as_rows_and_ask_for_the_next_batchs_rows():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    table = list(emb.named_parameters())
    ex = Exchange(sparse={"weight"})
    ex.attach(table, [0], None, True, False)
    ex.begin()
    emb(torch.tensor([7, 2, 7])).sum().backward()
    asked = []

    def want():
        asked.append(1)
        return torch.tensor([1, 4], dtype=torch.int32)

    push, keep = ex.push(0, 3, 0.0, 0, last=False, want=want)
    g = push.grads[0]
    assert g.n_rows == 2 and [g.row_ids[i] for i in range(2)] == [2, 7]
    assert [g.row_vals[i] for i in range(6)] == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    assert asked and push.n_want == 2 and [push.want[i] for i in range(2)] == [1, 4]
    assert ex.rows_pushed == 2 and ex.bytes_pushed == 4 * 2 + 4 * 6
    ex.begin()
    emb(torch.tensor([3])).sum().backward()
    asked.clear()
    push, _ = ex.push(1, 1, 0.0, 0, last=True, want=want)
    assert not asked and push.n_want == 0, "the epoch's last batch asks for nothing"
    ex2 = Exchange(sparse={"weight"})   # a run that cannot take rows: the gradient goes whole
    ex2.attach(table, [0], None, False, False)
    ex2.begin()
    emb(torch.tensor([3])).sum().backward()
    push, _ = ex2.push(0, 1, 0.0, 0, last=False)
    assert push.grads[0].n_rows == 0 and ex2.bytes_pushed == 4 * 30


def event_of(arrays, rows=None):
    ev = L.Event()
    n = len(arrays)
    ev.n_tensors = n
    ev.tensors = (L.c_float_p * n)(*[ctypes.cast(a, L.c_float_p) for a in arrays])
    ev.tensor_numel = (ctypes.c_size_t * n)(*[len(a) for a in arrays])
    if rows is not None:
        ev.row_ids = (ctypes.c_uint32 * len(rows))(*rows)
        ev.n_row_ids = len(rows)
    return ev


def test_a_replys_weights_go_into_the_parameters_whole_or_the_rows_asked_for():
    emb = torch.nn.Embedding(4, 2, sparse=True)
    lin = torch.nn.Linear(2, 1)
    table = [("emb.weight", emb.weight), ("lin.weight", lin.weight), ("lin.bias", lin.bias)]
    ex = Exchange(sparse={"emb.weight"})
    ex.attach(table, [0, 8, 10], None, True, False)
    w = [(ctypes.c_float * 8)(*range(8)), (ctypes.c_float * 2)(10, 11), (ctypes.c_float * 1)(12)]
    ex.load(event_of(w))
    assert emb.weight.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]] and lin.bias.item() == 12
    assert ex.changed() is None
    w2 = [(ctypes.c_float * 8)(*[-1.0] * 8), (ctypes.c_float * 2)(20, 21), (ctypes.c_float * 1)(22)]
    ex.load(event_of(w2, rows=[1, 3]))
    assert emb.weight.tolist() == [[0, 1], [-1, -1], [4, 5], [-1, -1]], "rows 1 and 3 only"
    assert lin.weight.tolist() == [[20, 21]], "dense tensors whole"
    with torch.no_grad():
        lin.bias.add_(1)   # an optimizer's step behind psd's back
    assert ex.changed() == "lin.bias"


def test_staged_layers_are_pushed_during_backward_and_the_rest_with_the_batch():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    table = list(m.named_parameters())
    ex = Exchange()
    offs = [0, 12, 16, 24]
    ex.attach(table, offs, 12345, False, True)   # staged: psd's region is not used
    assert ex.stg is not None and ex.region is None
    ex.begin()
    sent = []
    ex.backward(m(torch.ones(5, 3)).sum(), 2, 5, 1.0, 0, lambda push: sent.append(push.grads[0].tensor))
    assert sent and ex.layer_pushes == len(sent) and set(sent) == ex.early_sent
    push, _ = ex.push(2, 5, 1.0, 0, last=True)
    rest = sorted(push.grads[k].tensor for k in range(push.n_grads))
    assert sorted(sent + rest) == [0, 1, 2, 3], "each tensor once: during backward or with the batch"
    for k in rest:
        g = (ctypes.c_float * table[k][1].numel()).from_address(ptr(push.grads[k].data))
        assert torch.allclose(torch.tensor(list(g)), table[k][1].grad.reshape(-1))
    ex.close()
    assert ex.stg is None
