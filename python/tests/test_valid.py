"""psd.torch's validation answer (psd/_valid.py) alone: no psd. The user's fn over psd's part
in chunks, its sums added up exactly, and a wrong count refused."""
import pytest
import torch

from psd._valid import ValidationError, answer


def test_the_part_is_answered_in_chunks_and_the_sums_added_up():
    calls, beats = [], []

    def fn(split, ids):
        calls.append((split, list(ids)))
        return {"loss": torch.tensor(float(sum(ids))), "correct": len(ids) // 2, "count": len(ids),
                "abs_err": 0.5 * len(ids), "a_sum": torch.tensor([1.0])}

    loss, correct, count, sums = answer("val", list(range(10)), fn, 4, lambda: beats.append(1))
    assert calls == [("val", [0, 1, 2, 3]), ("val", [4, 5, 6, 7]), ("val", [8, 9])]
    assert len(beats) == 3, "psd hears from the worker after each chunk"
    assert (loss, correct, count) == (45.0, 2 + 2 + 1, 10)
    assert list(sums) == ["a_sum", "abs_err"] and sums == {"a_sum": 3.0, "abs_err": 5.0}


def test_no_autograd_while_validating():
    w = torch.ones(2, requires_grad=True)
    seen = []

    def fn(split, ids):
        seen.append((w * 2).requires_grad)
        return {"loss": 0.0, "count": len(ids)}

    answer("test", [1, 2, 3], fn, 500)
    assert seen == [False]


def test_a_count_that_is_not_the_parts_is_refused():
    with pytest.raises(ValidationError, match="counted 2 samples of 3"):
        answer("val", [1, 2, 3], lambda split, ids: {"loss": 0.0, "count": 2}, 10)


def test_without_a_count_the_part_is_counted_and_an_empty_part_is_zeros():
    assert answer("val", [7, 8], lambda split, ids: {"loss": 1.5}, 1)[:3] == (3.0, 0, 2)
    assert answer("val", [], lambda split, ids: {"loss": 1.0}, 8) == (0.0, 0, 0, {})
