"""The daemon's view of its state (what /status, /metrics and the page read) is taken when the core
has nothing else queued, and under load at most every VIEW_REFRESH_S: taken after every message it
cost O(learners x fragments) each, the daemon's limit with many learners."""

from ddiloco.core import syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.net import server as servers
from ddiloco.net.server import ServerConfig, SyncerServer


def test_the_view_is_taken_at_idle_and_under_load_at_most_every_refresh_interval(monkeypatch):
    s = SyncerServer(syncer.new_state(SyncerConfig()), ServerConfig(port=0, auth_token="view-token-0123456789"))
    queued = [True]
    monkeypatch.setattr(s.core, "empty", lambda: not queued[0])
    taken = []
    monkeypatch.setattr(servers, "view_of", lambda state: taken.append(state) or object())

    s._refresh_view(0.0)  # the first: nothing taken since the start
    s._refresh_view(servers.VIEW_REFRESH_S / 2)  # busy, and taken just now: not again
    assert len(taken) == 1
    s._refresh_view(servers.VIEW_REFRESH_S)  # busy, but the view is that old: taken
    assert len(taken) == 2
    queued[0] = False
    s._refresh_view(servers.VIEW_REFRESH_S)  # nothing queued: the latest state, at once
    assert len(taken) == 3 and all(state is s.shell.state for state in taken)
