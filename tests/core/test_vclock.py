"""Vector clocks: tick, merge, the order they define, the compact form and the limits."""

import pytest

from ddiloco.core import vclock
from ddiloco.core.vclock import Order, VClock, VClockError


def test_tick_and_merge_are_values():
    a = VClock()
    a1 = a.tick("a")
    assert a.as_dict() == {} and a1.as_dict() == {"a": 1}
    m = a1.merge({"syncer": 3, "a": 0})
    assert m.as_dict() == {"a": 1, "syncer": 3}
    assert m.merge(VClock({"a": 5})).get("a") == 5
    assert m.get("nobody") == 0


def test_a_message_orders_send_before_receive_and_leaves_strangers_concurrent():
    learner = VClock().tick("a")  # send
    syncer = VClock().merge(learner).tick("syncer")  # receive, handle
    assert learner.happens_before(syncer) and not syncer.happens_before(learner)
    assert syncer.compare(learner) is Order.AFTER
    other = VClock().tick("b")
    assert learner.compare(other) is Order.CONCURRENT
    assert syncer.compare(VClock({"syncer": 1, "a": 1})) is Order.EQUAL
    assert VClock({"a": 0}).compare(VClock()) is Order.EQUAL  # an absent entry counts 0


def test_json_form_is_compact_sorted_and_round_trips():
    c = VClock({"syncer": 7, "b": 2, "a": 0})
    assert c.to_json() == b'{"b":2,"syncer":7}'
    assert vclock.from_json(c.to_json()).as_dict() == c.as_dict()


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"": 1}, "name"),
        ({"a": -1}, "integer"),
        ({"a": 1.5}, "integer"),
        ({"a": True}, "integer"),
        ({"x" * (vclock.NAME_CHARS_MAX + 1): 1}, "name"),
        ([("a", 1)], "mapping"),
    ],
)
def test_bad_entries_are_refused_with_a_reason(bad, match):
    with pytest.raises(VClockError, match=match):
        VClock(bad)


def test_entry_limit_holds_for_building_and_merging():
    full = VClock({f"p{i}": 1 for i in range(vclock.ENTRIES_MAX)})
    with pytest.raises(VClockError, match="limit"):
        VClock({f"p{i}": 1 for i in range(vclock.ENTRIES_MAX + 1)})
    with pytest.raises(VClockError, match="limit"):
        full.merge({"one-more": 1})
    assert full.merge({"p0": 9}).get("p0") == 9  # no new name: still fits


def test_bad_json_is_refused():
    with pytest.raises(VClockError, match="JSON"):
        vclock.from_json(b"{not json")
    with pytest.raises(VClockError, match="object"):
        vclock.from_json(b"[1]")


def test_a_peer_counter_too_close_to_the_limit_is_not_merged_so_ticks_never_overflow():
    top = VClock({"syncer": vclock.MERGED_COUNTER_MAX})
    assert VClock().merge(top).tick("syncer").get("syncer") == vclock.MERGED_COUNTER_MAX + 1
    with pytest.raises(VClockError, match="above"):
        VClock().merge({"syncer": vclock.MERGED_COUNTER_MAX + 1})
    with pytest.raises(VClockError, match="above"):
        VClock().merge(VClock({"a": vclock.COUNTER_MAX}))  # a clock value is checked like a mapping
    # what is merged leaves 2**52 ticks: far more than any run makes
    assert vclock.COUNTER_MAX - vclock.MERGED_COUNTER_MAX >= 2**52 - 1
    with pytest.raises(VClockError, match="overflows"):
        VClock({"a": vclock.COUNTER_MAX}).tick("a")
    with pytest.raises(VClockError, match="2\\*\\*53"):
        VClock({"a": vclock.COUNTER_MAX + 1})
