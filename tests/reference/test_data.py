import numpy as np
import pytest

from ddiloco.reference import data


def test_vendored_corpus_is_verified_ascii_and_complete():
    texts = data.corpus()
    assert len(texts) == 42 and all(name in texts for name in data.HELD_OUT)
    total = sum(len(t) for t in texts.values())
    assert 4_500_000 < total < 5_500_000
    assert b"To be, or not to be" in texts["hamlet"]
    assert max(max(t) for t in texts.values()) < 128


def test_held_out_plays_never_in_training_text():
    train = data.train_bytes().tobytes()
    for name in data.HELD_OUT:
        probe = data.corpus()[name][5000:5200]  # a passage from inside the play
        assert probe not in train


def test_shards_are_disjoint_and_batches_deterministic():
    train = data.train_bytes()
    a, b = data.Shard(0, 4).slice(train), data.Shard(1, 4).slice(train)
    assert a.size == b.size and not np.shares_memory(a, b)
    x1, y1 = next(data.batches(a, 3, 16, np.random.default_rng(7)))
    x2, _ = next(data.batches(a, 3, 16, np.random.default_rng(7)))
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one


@pytest.mark.parametrize("text", ["4/4", "a/b", "1", "-1/3"])
def test_bad_shards(text):
    with pytest.raises(data.DataError):
        data.Shard.parse(text)


def test_choice_items_are_deterministic_and_well_formed():
    items = data.choice_items(40, 64, seed=3)
    assert items == data.choice_items(40, 64, seed=3)
    assert items != data.choice_items(40, 64, seed=4)
    held_out = data.eval_bytes().tobytes()
    answers = set()
    for it in items:
        assert len(it.options) == data.CHOICE_OPTIONS == len(set(it.options))
        assert all(o.endswith(b"\n") and len(o) > data.CHOICE_LINE_BYTES_MIN for o in it.options)
        assert it.context.endswith(b"\n") and len(it.context) >= data.CHOICE_CONTEXT_BYTES_MIN
        assert len(it.context) + max(len(o) for o in it.options) <= 64 + 1  # one model window
        assert it.context + it.options[it.answer] in held_out  # the true line continues the context
        answers.add(it.answer)
    assert answers == {0, 1, 2, 3}  # the true line is not always in the same place


def test_choice_arrays_mask_exactly_the_option_bytes():
    items = data.choice_items(3, 64, seed=0)
    x, y, mask, answers = data.choice_arrays(items, 64)
    assert x.shape == y.shape == mask.shape == (12, 64) and answers.tolist() == [it.answer for it in items]
    for r, (item, option) in enumerate((it, o) for it in items for o in it.options):
        n = len(item.context) + len(option) - 1
        assert bytes(y[r][mask[r] == 1].astype(np.uint8)) == option
        np.testing.assert_array_equal(x[r, 1:n], y[r, : n - 1])
    with pytest.raises(data.DataError, match="count"):
        data.choice_items(0, 64)
    with pytest.raises(data.DataError):
        data.ChoiceItem(b"ctx\n", (b"a\n", b"a\n"), 0)
