"""The click-through task's data for a model of your own (psd's model.kind ctr generator).

    g = psd.ctr.Generator(fields=8, per_field=1, vocab=1000, zipf=1.1, rows=65536,
                          weight_std=1.0, bias=-1.5, seed=1)      # deploy/configs/ctr.yaml's ctr: keys
    rows, labels, p = g.examples(ids)   # LongTensor [n, fields * per_field], LongTensor [n], DoubleTensor [n]

Examples are a pure function of (generator, index), the same bits as pworker's (the C
library's generator, common/ps_ctr.h): training examples are indices [0, train), test ones
[train, train + test). rows are the embedding-table rows each (field, value) is hashed to;
p is the planted model's click probability (its log-loss is the best any model can reach).
"""
import ctypes

import torch

from . import _lib as L

__all__ = ["Generator"]


class Generator:
    def __init__(self, fields=8, per_field=1, vocab=1000, zipf=1.1, rows=65536, weight_std=1.0, bias=-1.5, seed=1):
        self._lib = L.load()
        self._g = L.CtrGen(fields=fields, per_field=per_field, vocab=vocab, zipf=zipf, rows=rows,
                           weight_std=weight_std, bias=bias, seed=seed)
        self.fields, self.per_field, self.rows = fields, per_field, rows
        err = ctypes.create_string_buffer(256)
        if self._lib.psw_ctr_examples(ctypes.byref(self._g), None, 0, None, None, None, err, 256) != 0:
            raise ValueError("psd.ctr: %s" % err.value.decode(errors="replace"))

    def examples(self, index):
        """(rows, labels, p_click) of the examples index (a list or a tensor of ints)."""
        idx = torch.as_tensor(index, dtype=torch.int64).reshape(-1).contiguous()
        n, per = idx.numel(), self.fields * self.per_field
        rows = torch.empty(n, per, dtype=torch.int32)
        labels = torch.empty(n, dtype=torch.uint8)
        p = torch.empty(n, dtype=torch.float64)
        err = ctypes.create_string_buffer(256)
        u64 = ctypes.cast(idx.data_ptr(), ctypes.POINTER(ctypes.c_uint64))
        rc = self._lib.psw_ctr_examples(ctypes.byref(self._g), u64, n, ctypes.cast(rows.data_ptr(), L.c_u32_p),
                                        ctypes.cast(labels.data_ptr(), ctypes.POINTER(ctypes.c_uint8)),
                                        ctypes.cast(p.data_ptr(), ctypes.POINTER(ctypes.c_double)), err, 256)
        if rc != 0:
            raise ValueError("psd.ctr: %s" % err.value.decode(errors="replace"))
        return rows.long(), labels.long(), p
