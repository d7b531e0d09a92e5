"""Parameters on a device (CUDA): their traffic with psd through host buffers.

Gradients: a hook on each parameter copies its gradient, as soon as backward has
computed it, into one host buffer laid out as psd lays the model out (so the push
sends whole units from it without a copy), on a side stream (pinned memory: the copy
runs while backward goes on with the layers below), and says so (on_ready), so a
caller that knows the batch's figures can push that layer at once. Weights: psd's
are copied into a second host buffer, then to the parameters on the side stream;
the compute stream waits for those copies, the caller does not.

bfloat16 on the wire (psd's train.wire_gradients / train.wire_weights: bf16): the
gradient is rounded on the device (on the side stream) and the host buffer holds
bfloat16, which the worker library sends as it is (psw_client_bf16_given); the weights
come into a bfloat16 host buffer as psd sent them and are widened on the device. Host
buffers and copies are then half the bytes; the parameters and psd's master weights stay
float32.

On CPU tensors (Worker(staging=True)) the same code runs with the copies made
synchronously: how the tests cover it without a GPU. Owned by psd.torch.Worker.
"""
import torch


class Staging:
    def __init__(self, table, offsets, g16=False, w16=False):
        self.table = table
        self.g16, self.w16 = bool(g16), bool(w16)
        dev = table[0][1].device
        self.cuda = dev.type == "cuda"
        n = max(int(o) + p.numel() for o, (_, p) in zip(offsets, table))
        self.grads = torch.zeros(n, dtype=torch.bfloat16 if g16 else torch.float32, pin_memory=self.cuda)
        self.weights = torch.empty(n, dtype=torch.bfloat16 if w16 else torch.float32, pin_memory=self.cuda)
        self.gviews = [self.grads[int(o):int(o) + p.numel()].view(p.shape) for o, (_, p) in zip(offsets, table)]
        self.wviews = [self.weights[int(o):int(o) + p.numel()].view(p.shape) for o, (_, p) in zip(offsets, table)]
        self.stream = torch.cuda.Stream(dev) if self.cuda else None
        self.events = [None] * len(table)
        self.loaded = None       # the event of the last weights' copies to the device
        self.staged = [False] * len(table)
        self.order = []          # staged tensors in the order backward gave them
        self.on_ready = None     # f(k): tensor k's gradient is staged (or on its way: ready(k) says)
        self.hooks = [p.register_hook(self._hook(k)) for k, (_, p) in enumerate(table)]

    def close(self):
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def _hook(self, k):
        def hook(grad):
            self.stage(k, grad)
        return hook

    def stage(self, k, grad):
        v = self.gviews[k]
        g = grad.detach()
        if g.is_sparse:
            raise ValueError("psd: sparse gradients of device parameters are not pushed as rows yet: "
                             "keep the embedding on the CPU")
        if self.staged[k]:  # a second gradient of the same parameter in this batch: added (in float32)
            self.wait(k)
            v.copy_(v.float() + g.to("cpu").float().view_as(v))
            return
        if self.cuda:
            s = self.stream
            s.wait_stream(torch.cuda.current_stream(g.device))
            with torch.cuda.stream(s):
                src = g.to(v.dtype) if v.dtype != g.dtype else g  # bfloat16: rounded on the device
                v.copy_(src.view_as(v), non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(s)
            g.record_stream(s)  # its memory is not reused before the side stream has read it
            self.events[k] = ev
        else:
            v.copy_((g.to(v.dtype) if v.dtype != g.dtype else g).view_as(v))
        self.staged[k] = True
        self.order.append(k)
        if self.on_ready is not None:
            self.on_ready(k)

    def ready(self, k):
        return self.events[k] is None or self.events[k].query()

    def wait(self, k):
        if self.events[k] is not None:
            self.events[k].synchronize()
            self.events[k] = None

    def begin(self):
        """Before a batch's backward (after psd's reply to the last push: the host buffer is free)."""
        self.staged = [False] * len(self.table)
        self.order = []
        for _, p in self.table:
            p.grad = None  # the hooks take the gradients; none is kept on the device between batches

    def finish(self):
        """All of the batch's gradients in the host buffer: those backward did not reach are zero."""
        for k in range(len(self.table)):
            if self.staged[k]:
                self.wait(k)
            else:
                self.gviews[k].zero_()

    def load(self, srcs):
        """New weights (host tensors, one a parameter) into the parameters before the next forward."""
        if self.loaded is not None:  # the last copies read the buffer: done before it is written
            self.loaded.synchronize()
            self.loaded = None
        with torch.no_grad():
            for v, src in zip(self.wviews, srcs):
                v.copy_(src)
            if not self.cuda:
                for (_, p), v in zip(self.table, self.wviews):
                    p.data.copy_(v)
                return
            s = self.stream
            s.wait_stream(torch.cuda.current_stream(s.device))  # the last forward and backward read them
            with torch.cuda.stream(s):
                for (_, p), v in zip(self.table, self.wviews):
                    if v.dtype != p.dtype:  # bfloat16: over to the device as it is, widened there
                        p.data.copy_(v.to(p.device, non_blocking=True))
                    else:
                        p.data.copy_(v, non_blocking=True)
                self.loaded = torch.cuda.Event()
                self.loaded.record(s)
            torch.cuda.current_stream(s.device).wait_stream(s)
