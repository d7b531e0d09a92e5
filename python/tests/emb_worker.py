"""A torch worker with an EmbeddingBag for the tests: the click-through generator's examples
(psd.ctr, a small task), bags of 2 values for each of 4 fields averaged, then an MLP. Prints
its pushes' figures at the end.

    emb_worker.py ENDPOINT [--dense] [--densify] [--rows-of] [--per-field P]

--dense: EmbeddingBag(sparse=False) (the gradient goes whole); --rows-of: the worker tells
psd the rows each next batch reads (the replies bring only those); --densify: the sparse
gradient made dense before each step (the same gradient, pushed whole); --per-field P: bags of
P values (4 x P table rows a sample).
"""
import argparse
import sys

import torch
import torch.nn.functional as F

import psd.ctr
import psd.torch as pst

GEN = dict(fields=4, per_field=2, vocab=300, zipf=1.1, rows=8192, weight_std=1.0, bias=-1.0, seed=3)
TRAIN, TEST = 2000, 500


class Net(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(GEN["rows"], 8, mode="mean", sparse=sparse)
        self.fc1 = torch.nn.Linear(GEN["fields"] * 8, 16)
        self.fc2 = torch.nn.Linear(16, 2)

    def forward(self, rows):
        n, per = rows.shape
        P = GEN["per_field"]
        bags = self.emb(rows.reshape(-1), torch.arange(0, n * per, P))
        return self.fc2(F.relu(self.fc1(bags.reshape(n, -1))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--rows-of", action="store_true")
    ap.add_argument("--densify", action="store_true")
    ap.add_argument("--per-field", type=int, default=GEN["per_field"])
    a = ap.parse_args()
    GEN["per_field"] = a.per_field
    torch.manual_seed(0)
    torch.set_num_threads(1)
    g = psd.ctr.Generator(**GEN)
    model = Net(sparse=not a.dense)
    rows_of = (lambda ids: g.examples(ids)[0]) if a.rows_of else None
    w = pst.Worker(a.endpoint, model, train_size=TRAIN, test_size=TEST, data_id="ctr-small", rows_of=rows_of)
    touched = 0

    def evaluate(split, ids):
        rows, y, _ = g.examples([i + (TRAIN if split == "test" else 0) for i in ids])
        out = model(rows)
        return {"loss": F.cross_entropy(out, y, reduction="sum").item(),
                "correct": int((out.argmax(1) == y).sum()), "count": len(ids)}

    for epoch in w.epochs():
        for ids in w.batches():
            rows, y, _ = g.examples(ids)
            if a.densify:
                model.emb.weight.grad = None  # a new sparse gradient, not one added into the last dense one
            touched += torch.unique(rows).numel()
            out = model(rows)
            loss = F.cross_entropy(out, y, reduction="sum")
            (loss / len(ids)).backward()
            if a.densify:
                model.emb.weight.grad = model.emb.weight.grad.coalesce().to_dense()
            w.step(loss_sum=loss.item(), batch=len(ids), correct=int((out.argmax(1) == y).sum()))
        w.validate(evaluate)
    print("steps %d bytes_pushed %d rows_pushed %d rows_touched %d" % (w.steps, w.bytes_pushed, w.rows_pushed,
                                                                        touched))
    return 0


if __name__ == "__main__":
    sys.exit(main())
