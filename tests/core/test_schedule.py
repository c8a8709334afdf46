import pytest

from ddiloco.core.schedule import Schedule, ScheduleError, default_offsets


def test_paper_setting_one_fragment_per_step():
    s = Schedule(period=24, num_fragments=24, overlap=2)
    assert s.offsets == tuple(range(24))
    for t in range(100):
        assert s.due(t) == (t % 24,)


def test_default_offsets_spread():
    assert default_offsets(12, 4) == (0, 3, 6, 9)
    assert default_offsets(4, 8) == (0, 0, 1, 1, 2, 2, 3, 3)
    s = Schedule(period=4, num_fragments=8)
    assert s.due(5) == (2, 3)


def test_every_fragment_once_per_period():
    s = Schedule(period=10, num_fragments=3)
    counts = [0, 0, 0]
    for t in range(50):
        for p in s.due(t):
            counts[p] += 1
    assert counts == [5, 5, 5]


def test_opened_between_never_skips_and_caps_at_one_period():
    s = Schedule(period=6, num_fragments=3)  # offsets 0, 2, 4
    assert s.opened_between(0, 5) == ((0, 0), (2, 1), (4, 2))
    # a jump of many steps opens each fragment once, at its latest opening
    assert s.opened_between(0, 100) == ((94, 2), (96, 0), (98, 1))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(period=0, num_fragments=1), "period H"),
        (dict(period=4, num_fragments=0), "number of fragments"),
        (dict(period=4, num_fragments=2, overlap=5), "overlap"),
        (dict(period=4, num_fragments=2, offsets=(0,)), "1 offsets given for 2"),
        (dict(period=4, num_fragments=2, offsets=(0, 4)), r"\[0, H=4\)"),
    ],
)
def test_bad_schedules(kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        Schedule(**kwargs)
