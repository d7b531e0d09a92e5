"""A psd.torch worker's answer to psd's validation: the user's fn over the part psd gave,
a chunk of at most val_batch_size ids at a time, its sums added up and checked (psd.torch's
Worker owns the calls; no I/O here: tested alone in python/tests/test_valid.py).

fn(split, ids) returns {"loss": sum, "correct": n, "count": len(ids), "NAME": sum, ...}
(values: numbers or one-element tensors). The answer is (loss, correct, count, {NAME: sum})
with the named sums in name order, as psd's VAL_RESULT carries them.
"""
import re

import torch

_RESERVED = {"acc", "correct", "count", "samples", "auc"}


def psd_name(key):
    """The name psd gives a value a framework logs in validation (psd.lightning, psd.ignite):
    "loss" (psd's val_loss) for val_loss or loss, "correct" (psd's val_acc, counted: the value
    is a fraction of the samples) for val_acc, acc or accuracy, else the key in [a-z0-9_]
    without a leading val_ (psd's metrics file: val_NAME)."""
    n = re.sub("[^a-z0-9_]", "_", key.lower())
    if n.startswith("val_") and len(n) > 4:
        n = n[4:]
    if n == "loss":
        return "loss"
    if n in ("acc", "accuracy"):
        return "correct"
    if n in _RESERVED:
        n = "val_" + n
    return n[:32]


class ValidationError(ValueError):
    """fn's sums do not fit the part (its count differs from the ids it was given)."""


def answer(split, ids, fn, chunk, after_chunk=None):
    """fn over ids in chunks of at most chunk ids (after_chunk() after each: psd's heartbeat),
    without autograd; returns (loss, correct, count, sums) or raises ValidationError."""
    sums = {}
    step = max(1, int(chunk))
    with torch.no_grad():
        for at in range(0, len(ids), step):
            part = fn(split, ids[at:at + step])
            for key, v in part.items():
                sums[key] = sums.get(key, 0) + (v.item() if torch.is_tensor(v) else v)
            if after_chunk is not None:
                after_chunk()
    count = int(sums.pop("count", len(ids)))
    if count != len(ids):
        raise ValidationError("psd: the validation function counted %d samples of %d" % (count, len(ids)))
    loss = float(sums.pop("loss", 0.0))
    correct = int(sums.pop("correct", 0))
    return loss, correct, count, {k: float(sums[k]) for k in sorted(sums)}
