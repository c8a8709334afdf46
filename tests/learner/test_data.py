import numpy as np
import pytest

from ddiloco.learner import data


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
