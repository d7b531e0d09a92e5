"""bench/torch_step.sh's GRU: a small recurrent classifier (GRU 8 -> 32 over 20 steps,
a linear head to 4 classes: 4,164 parameters) on synthetic sequences, batch 32, Adam
lr 1e-3, 1 thread. Either one plain PyTorch process (zero_grad, forward, backward,
opt.step()) or a psd.torch worker (forward, backward, w.step(); psd runs the Adam),
on the same batches: the same sample ids in the same order (psd's, for the plain run
read from IDS, which the psd run wrote).

    torch_gru_step.py psd ENDPOINT IDS     (writes each epoch's batches to IDS)
    torch_gru_step.py plain IDS            (steps the batches IDS holds)

Prints one line "RESULT {json}": steps, the wall time of the training loops (the
epochs' batches, validation and start-up excluded) and ms a step; for psd also the
worker's wait_s (its push and pull waits inside those loops).
"""
import json
import sys
import time

import torch
import torch.nn.functional as F

N, T, IN, HID, CLASSES, BATCH = 4096, 20, 8, 32, 4, 32


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = torch.nn.GRU(IN, HID, batch_first=True)
        self.head = torch.nn.Linear(HID, CLASSES)

    def forward(self, x):
        return self.head(self.gru(x)[0][:, -1])


def data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, T, IN, generator=g)
    y = (x[:, :, :CLASSES].sum(1)).argmax(1)
    return x, y


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net()
    x, y = data()
    mode = sys.argv[1]
    if mode == "plain":
        batches = [json.loads(line) for line in open(sys.argv[2])]
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        t0 = time.perf_counter()
        for idx in batches:
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
        loop = time.perf_counter() - t0
        print("RESULT " + json.dumps({"steps": len(batches), "loop_s": loop, "ms": 1e3 * loop / len(batches)}))
        return 0
    import psd.torch as pst
    seen = []
    w = pst.Worker(sys.argv[2], model, train_size=N, test_size=256, data_id="gru-bench-v1", threads=1,
                   optimizer=torch.optim.Adam(model.parameters(), lr=1e-3))
    xt, yt = x[:256], y[:256]

    def evaluate(split, idx):
        with torch.no_grad():
            o = model(xt[idx])
        return {"loss": F.cross_entropy(o, yt[idx], reduction="sum").item(),
                "correct": int((o.argmax(1) == yt[idx]).sum()), "count": len(idx)}

    loop, steps = 0.0, 0
    for _ in w.epochs():
        t0 = time.perf_counter()
        for idx in w.batches():
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            w.step(loss_sum=loss.item() * len(idx), batch=len(idx))
            seen.append(idx)
            steps += 1
        loop += time.perf_counter() - t0
        w.validate(evaluate)
    with open(sys.argv[3], "w") as f:
        f.writelines(json.dumps(list(i)) + "\n" for i in seen)
    print("RESULT " + json.dumps({"steps": steps, "loop_s": loop, "ms": 1e3 * loop / max(steps, 1),
                                  "wait_s": w.wait_s, "train_s": w.train_s}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
