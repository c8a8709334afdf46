import pytest

from ddiloco.core.weights import normalised, token_weight


def test_quantity_times_quality():
    # same tokens over fewer steps (bigger batches) weighs more
    assert token_weight(1000, 10) == pytest.approx(100_000)
    assert token_weight(1000, 5) == pytest.approx(200_000)
    assert token_weight(2000, 10) == pytest.approx(4 * token_weight(1000, 10))
    assert token_weight(0, 0) == 0.0


def test_bad_counters():
    with pytest.raises(ValueError, match="0 steps"):
        token_weight(5, 0)
    with pytest.raises(ValueError, match="counters"):
        token_weight(-1, 3)


def test_normalised():
    assert normalised([1.0, 3.0]) == [0.25, 0.75]
    with pytest.raises(ValueError, match="positive weight"):
        normalised([0.0, 0.0])
    with pytest.raises(ValueError, match="finite"):
        normalised([float("nan"), 1.0])
