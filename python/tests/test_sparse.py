"""Sparse embeddings through psd.torch: an EmbeddingBag(sparse=True) pushes its gradient as the
rows the batch touched (emb_worker.py, psd.ctr's click-through examples), psd steps them lazily."""
import ctypes

import pytest

import psd.ctr
from psd import _lib

from conftest import safetensors  # the run fixture: conftest.py

SGD = ("--set", "optimizer.momentum=0", "--set", "optimizer.nesterov=false", "--set", "run.epochs=2")


def figures(out):
    """steps, bytes_pushed, rows_pushed, rows_touched of emb_worker.py's last line."""
    words = out.split()
    return {k: int(words[words.index(k) + 1]) for k in ("steps", "bytes_pushed", "rows_pushed", "rows_touched")}


def test_the_generator_is_the_c_librarys():
    g = psd.ctr.Generator(fields=4, per_field=2, vocab=300, rows=8192, seed=3)
    rows, labels, p = g.examples(range(1000))
    again, _, _ = g.examples([999, 0])
    assert rows.shape == (1000, 8) and (rows >= 0).all() and (rows < 8192).all()
    assert (again[0] == rows[999]).all() and (again[1] == rows[0]).all()
    assert set(labels.tolist()) == {0, 1} and ((p > 0) & (p < 1)).all()
    other, _, _ = psd.ctr.Generator(fields=4, per_field=2, vocab=300, rows=8192, seed=4).examples(range(1000))
    assert not (other == rows).all()
    with pytest.raises(ValueError, match="zipf"):
        psd.ctr.Generator(zipf=0)
    assert _lib.load().psw_struct_size(b"psw_ctr_gen_t") == ctypes.sizeof(_lib.CtrGen)


def test_sparse_gradients_go_as_rows_and_step_as_the_dense_gradient(run, tmp_path):
    """Plain SGD, one worker, 2 epochs: the EmbeddingBag's gradient pushed as rows (exactly the
    rows each batch touched, their bytes only) gives bit for bit the tensors of the same gradient
    pushed whole; with rows_of (the replies bring only the rows the next batch reads) too."""
    out = {}
    for mode in ("rows", "whole", "rows_of"):
        d = tmp_path / mode
        d.mkdir()
        r = run(1, extra=SGD + ("--save", str(d / "w.safetensors")))
        flag = {"rows": (), "whole": ("--densify",), "rows_of": ("--rows-of",)}[mode]
        p = r.worker(*flag, script="emb_worker.py")
        o, e = p.communicate(timeout=120)
        assert p.returncode == 0 and r.psd.wait(timeout=60) == 0, e + r.psd_log()
        out[mode] = (figures(o), safetensors(d / "w.safetensors"))
        r.kill()
    rows, whole = out["rows"][0], out["whole"][0]
    assert rows["rows_pushed"] == rows["rows_touched"] > 0
    table = 8192 * 8 * 4
    # rows: 4 bytes of id and 32 of values a row, plus the MLP's tensors whole every step
    mlp = (whole["bytes_pushed"] - whole["steps"] * table) // whole["steps"]
    assert rows["bytes_pushed"] == rows["rows_pushed"] * 36 + rows["steps"] * mlp
    assert whole["rows_pushed"] == 0 and whole["bytes_pushed"] > 20 * rows["bytes_pushed"]
    assert out["rows"][1] == out["whole"][1]
    assert out["rows_of"][1] == out["rows"][1]
