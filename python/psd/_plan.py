"""A psd.torch worker's sample plan: the samples psd gave it for the epoch and where it is
in them (psd.torch.Worker owns one). No I/O, no torch: psd's events come in as lists of
sample ids, so the plan is tested alone (python/tests/test_plan.py).

    ids      the epoch's sample ids, in psd's order (psd may add some, or take the last
             ones back when it moves samples between workers)
    pos      how many of ids are pushed (their gradients are psd's)
    cur      the batch being computed: (start, end) in ids, or None
    A DataLoader reads ahead: the batches handed to it (by the batch sampler, hand())
    are tracked as [start, end, gen] entries in fifo, in the loader's order; handed is
    how far they go. gen is bumped whenever ids is replaced: every handed entry of an
    older gen is void (its samples are no longer this worker's at those positions).
    head is the handed entry whose weights are awaited (out of fifo, void-able too).
"""
import collections


class Plan:
    def __init__(self):
        self.ids = []
        self.pos = 0
        self.cur = None
        self.handed = 0
        self.fifo = collections.deque()
        self.gen = 0
        self.head = None

    def adopt(self, ids):
        """A new epoch's (or the same epoch's anew) samples: everything handed is void."""
        self.ids = list(ids)
        self.pos = 0
        self.cur = None
        self.gen += 1
        self.handed = 0
        self.fifo.clear()

    def void_handed(self):
        """Every batch handed to a loader is void (a new session: psd gives the epoch anew)."""
        self.gen += 1
        self.fifo.clear()

    def extend(self, ids):
        """psd added samples to this worker's epoch (a lost worker's, or rebalancing)."""
        self.ids.extend(ids)

    def keep(self, n):
        """psd took back all but the first n samples: a loader's batches past n are void for
        good (samples added later take those positions: other samples); the part of one
        before n is handed again."""
        del self.ids[n:]
        cut = min(self.handed, len(self.ids))
        for ent in ([self.head] if self.head else []) + list(self.fifo):
            if ent[2] == self.gen and ent[1] > len(self.ids):
                cut = min(cut, ent[0])
                ent[2] = -1
        self.handed = max(cut, self.pos)

    def done(self):
        """Every sample of the epoch so far is pushed."""
        return self.pos >= len(self.ids)

    def next_batch(self, size):
        """The next batch's ids (without a loader): it becomes cur."""
        a = self.pos
        b = self.ids[a:a + size]
        self.cur = (a, a + len(b))
        return b

    def pushed(self):
        """cur's gradients are pushed: True if that was the epoch's last sample so far."""
        self.pos = self.cur[1]
        self.cur = None
        return self.done()

    def upcoming(self, size):
        """The ids of the batch after the one pushed now (for rows_of)."""
        return self.ids[self.pos:self.pos + size]

    def hand(self, size):
        """The batch sampler's batches: the samples not handed yet, a batch at a time."""
        while self.handed < len(self.ids):
            a = self.handed
            b = self.ids[a:a + size]
            self.handed += len(b)
            self.fifo.append([a, a + len(b), self.gen])
            yield list(b)

    def hand_count(self, size):
        """How many batches hand() has left to give (a DataLoader's len())."""
        return (max(0, len(self.ids) - self.handed) + size - 1) // max(1, size)

    def restart_hand(self):
        """A new pass of the loader: it is handed what is not pushed yet."""
        self.handed = self.pos
        self.fifo.clear()

    def valid(self, ent):
        """A handed entry is still the next batch of this worker's samples."""
        return ent[2] == self.gen and ent[0] == self.pos and ent[1] <= len(self.ids)
