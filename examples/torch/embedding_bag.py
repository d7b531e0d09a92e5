"""A PyTorch EmbeddingBag model of psd's click-through task, trained by psd: one per worker.

    python3 examples/torch/embedding_bag.py tcp://127.0.0.1:5555 [--threads 1]

with psd started on examples/torch/embedding_bag.yaml. The data are psd.ctr's generator with
deploy/configs/ctr.yaml's settings (8 fields, 65,536 x 8 table, 200,000 training and 20,000
test examples: the same examples pworker trains on with model.kind ctr). The embedding is
sparse: each step pushes only the table rows its batch touched, and the replies bring only
the rows the next batch reads (rows_of).
"""
import argparse
import math
import sys

import torch
import torch.nn.functional as F

import psd.ctr
import psd.torch as pst

GEN = dict(fields=8, per_field=1, vocab=1000, zipf=1.1, rows=65536, weight_std=1.0, bias=-1.5, seed=1)
TRAIN, TEST, DIM = 200000, 20000, 8


class Net(torch.nn.Module):
    """Each field's values averaged into a bag of the table's rows, the bags into an MLP
    64 -> 64 -> 2 (pworker's ctr model), He-uniform initial weights as psd's."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.EmbeddingBag(GEN["rows"], DIM, mode="mean", sparse=True)
        self.fc1 = torch.nn.Linear(GEN["fields"] * DIM, 64)
        self.fc2 = torch.nn.Linear(64, 2)
        for t in (self.embedding.weight, self.fc1.weight, self.fc2.weight):
            bound = math.sqrt(6.0 / t.shape[1])
            torch.nn.init.uniform_(t, -bound, bound)
        torch.nn.init.zeros_(self.fc1.bias)
        torch.nn.init.zeros_(self.fc2.bias)

    def forward(self, rows):
        n, per = rows.shape
        bags = self.embedding(rows.reshape(-1), torch.arange(0, n * per, GEN["per_field"]))
        return self.fc2(F.relu(self.fc1(bags.reshape(n, -1))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)  # the first worker's initial values are the run's
    gen = psd.ctr.Generator(**GEN)
    model = Net()
    w = pst.Worker(a.endpoint, model, train_size=TRAIN, test_size=TEST, data_id="psd-ctr-%(seed)d" % GEN,
                   threads=a.threads, rows_of=lambda ids: gen.examples(ids)[0])

    def evaluate(split, ids):  # test examples follow the training ones
        rows, y, _ = gen.examples([i + (TRAIN if split == "test" else 0) for i in ids])
        out = model(rows)
        return {"loss": F.cross_entropy(out, y, reduction="sum").item(),
                "correct": int((out.argmax(1) == y).sum()), "count": len(ids)}

    for epoch in w.epochs():
        for ids in w.batches():
            rows, y, _ = gen.examples(ids)
            out = model(rows)
            loss = F.cross_entropy(out, y, reduction="sum")
            (loss / len(ids)).backward()
            w.step(loss_sum=loss.item(), batch=len(ids), correct=int((out.argmax(1) == y).sum()))
        w.validate(evaluate)
        w.log("epoch %d done: %d table rows pushed, %.1f KB of gradients a step" % (
            epoch + 1, w.rows_pushed, w.bytes_pushed / max(w.steps, 1) / 1e3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
