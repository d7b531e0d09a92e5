#!/usr/bin/python3
"""PyTorch counterpart of bench/gpu_step.c: one training step of an MLP on a GPU.

    python3 bench/torch_gpu_step.py [--steps 200] [--warmup 20] [--batch 512] [--device 0]

Same task as gpu_step: MLP 784-4096-4096-10 (nn.Linear + nn.ReLU, mean
nn.CrossEntropyLoss), fp32, batch 512 of random inputs in [0, 1) and random
labels, made once on the GPU. TF32 is off (torch.backends.cuda.matmul.allow_tf32
= False, float32 matmul precision "highest"), as psw's cuBLAS calls use
CUBLAS_DEFAULT_MATH. A step is forward + backward + zero_grad(set_to_none=True)
(no optimizer step; psw overwrites its gradients too); 20 warm-up steps, then
200 timed between torch.cuda.synchronize() calls. tflops counts the same GEMM
flops as gpu_step: 2*B*in*out for forward and dW of every layer and for dx of
every layer but the first (the input needs no gradient).

Last line: TORCH_STEP {json}. No torch or no CUDA: a message and exit 77.
"""

import argparse
import json
import sys
import time

EXIT_SKIP = 77


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args()

    try:
        import torch
        from torch import nn
    except ImportError as e:
        print(f"no CUDA device: torch is not importable ({e})")
        return EXIT_SKIP
    if not torch.cuda.is_available():
        print("no CUDA device: torch.cuda.is_available() is False")
        return EXIT_SKIP

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    sizes = [784, 4096, 4096, 10]
    B = args.batch
    dev = torch.device("cuda", args.device)
    torch.manual_seed(42)
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers).to(dev)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator(device=dev)
    g.manual_seed(42)
    x = torch.rand(B, sizes[0], device=dev, generator=g)
    y = torch.randint(0, sizes[-1], (B,), device=dev, generator=g)

    def step():
        loss = loss_fn(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    first_loss = None
    for s in range(args.warmup):
        loss = step()
        if s == 0:
            first_loss = loss.item()
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize(dev)
    dt = (time.perf_counter() - t0) / args.steps

    flops = sum(2.0 * B * sizes[i] * sizes[i + 1] * (2 if i == 0 else 3)
                for i in range(len(sizes) - 1))
    out = {
        "ms_per_step": round(dt * 1e3, 4),
        "steps_per_s": round(1.0 / dt, 2),
        "tflops": round(flops / dt * 1e-12, 3),
        "batch": B,
        "layers": sizes,
        "steps": args.steps,
        "warmup": args.warmup,
        "first_loss": first_loss,
        "device": torch.cuda.get_device_name(dev),
        "torch_version": torch.__version__,
        "tf32": torch.backends.cuda.matmul.allow_tf32,
    }
    print("TORCH_STEP " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
