"""psd.torch's sample plan (psd/_plan.py) alone: no psd, no torch. What psd's EPOCH events do
to a worker's samples, and a DataLoader's read-ahead batches through them."""
from psd._plan import Plan


def test_batches_without_a_loader_cover_the_epoch_once():
    p = Plan()
    p.adopt(range(10))
    got = []
    while not p.done():
        got.append(p.next_batch(4))
        last = p.pushed()
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] and last and p.cur is None


def test_samples_psd_adds_come_after_the_others():
    p = Plan()
    p.adopt([5, 6, 7])
    p.next_batch(2)
    assert not p.pushed()
    p.extend([100, 101])
    assert p.upcoming(2) == [7, 100]
    p.next_batch(2)
    p.pushed()
    assert p.next_batch(2) == [101]


def test_a_loaders_batches_past_what_psd_keeps_are_void_and_the_cut_one_is_handed_again():
    """The loader read ahead 3 batches of 4 (positions 0-12) and computed the first; psd takes
    back all but 6 samples: the batch [4, 8) is cut (handed again from 4: [4, 6)), [8, 12)
    is void for good; samples psd adds later take positions 6.. and are handed anew."""
    p = Plan()
    p.adopt(range(20))
    h = p.hand(4)
    handed = [next(h) for _ in range(3)]
    assert handed == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] and p.handed == 12
    first = p.fifo.popleft()
    assert p.valid(first)
    p.cur = (first[0], first[1])
    p.pushed()
    p.keep(6)
    assert p.ids == list(range(6)) and p.handed == 4
    assert [e[2] for e in p.fifo] == [-1, -1], "both read-ahead batches past 6 are void"
    assert not any(p.valid(e) for e in p.fifo)
    p.extend([50, 51, 52])
    assert list(p.hand(4)) == [[4, 5, 50, 51], [52]]


def test_a_new_epoch_voids_every_handed_batch():
    p = Plan()
    p.adopt(range(8))
    h = p.hand(4)
    ent_batch = next(h)
    ent = p.fifo[0]
    assert ent_batch == [0, 1, 2, 3] and p.valid(ent)
    p.adopt(range(8, 16))
    assert not p.valid(ent) and p.handed == 0 and p.hand_count(4) == 2
    p.void_handed()
    assert len(p.fifo) == 0


def test_the_loaders_length_is_the_batches_not_handed_yet():
    p = Plan()
    p.adopt(range(10))
    assert p.hand_count(4) == 3
    next(p.hand(4))
    assert p.hand_count(4) == 2
    p.restart_hand()
    assert p.handed == p.pos == 0 and p.hand_count(4) == 3
