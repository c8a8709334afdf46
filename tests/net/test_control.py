"""The plain HTTP client of the syncer's control endpoints (the request itself: tests/examples)."""

import socket

import pytest

from ddiloco.net.control import ControlError, http_base, request_checkpoint


@pytest.mark.parametrize(
    "url, base",
    [
        ("ws://127.0.0.1:8470/ws", "http://127.0.0.1:8470"),
        ("wss://syncer.example/ws/", "https://syncer.example"),
        ("http://127.0.0.1:8470", "http://127.0.0.1:8470"),
        ("http://10.0.0.1:1/", "http://10.0.0.1:1"),
    ],
)
def test_http_base_from_the_websocket_url_or_the_http_address(url, base):
    assert http_base(url) == base


def test_a_url_of_another_scheme_is_refused():
    with pytest.raises(ValueError, match="must start with ws://"):
        http_base("127.0.0.1:8470")


def test_an_unreachable_syncer_is_one_clear_error():
    with socket.socket() as s:  # a port that was free a moment ago and has no listener
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ControlError, match=f"cannot reach the syncer at http://127.0.0.1:{port}"):
        request_checkpoint(f"ws://127.0.0.1:{port}/ws", "some-token", timeout_s=10)
