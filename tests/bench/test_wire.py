"""`bench.wire`: the same bytes over a real loopback websocket (aiohttp) and a bare socket, each
between two spawned processes."""

import pytest

from ddiloco.bench.wire import wire_cost


def test_every_byte_crosses_each_transport_and_both_sides_cpu_is_counted():
    r = wire_cost(8 << 20, 1 << 20)
    assert set(r) == {"websocket", "tcp"}
    for cost in r.values():
        assert cost["gbps"] >= 0  # first to last arrival: 0 where one read took everything
        assert cost["sender_cpu_s"] > 0 and cost["receiver_cpu_s"] > 0
        assert cost["cpu_s"] == pytest.approx(cost["sender_cpu_s"] + cost["receiver_cpu_s"])
        assert cost["cpu_ns_per_byte"] == pytest.approx(1e9 * cost["cpu_s"] / (8 << 20))


@pytest.mark.parametrize("total, message", [(1 << 20, 0), (1 << 20, 2 << 20)])
def test_a_message_must_fit_the_bytes_sent(total, message):
    with pytest.raises(ValueError, match="message_bytes"):
        wire_cost(total, message)
