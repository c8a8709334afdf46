"""A learner's link to a syncer split into shards: one client per shard, one transport for the hook.

A sharded syncer (core.shards) is N processes, shard i owning the fragments p with p mod N == i.
`ShardedClient` keeps a `ThreadedClient` to each and satisfies `learner.transport.Transport`, so the
hook talks to the shards as to one syncer:

- `wait_welcome` waits for every shard's welcome and checks that they describe one syncer (the same
  layout, fragment count and round schedule; shard indices 0..N-1, each once); the welcome it hands
  over is merged (`merge_welcomes`): each fragment's version from its owner, the largest global
  step, shard 0's learner id and peers, and which shards ask for the initial parameters.
- `push` and `init` go to the fragment's owner; `progress` goes to every shard, as soon as the
  learner holds every fragment that shard owns (a shard ignores the versions of the others').
- `take` merges what every shard sent. A shard's new welcome (it restarted, or its connection was
  lost and made again) is handed over as that shard's own welcome, one per `take`, so that the hook
  resets only that shard's fragments (`WelcomeInfo.owned`); what that shard sent with it waits with
  it. Until the hook has seen it, nothing goes to that shard: what the hook made before speaks of
  that shard's previous session.
- Consistent snapshots: markers get ids of this transport's own (shards number their snapshots
  each on their own), and the local state goes back to the shard whose marker it answers.

One shard down never holds up the others: its client reconnects on its own thread, pushes for its
fragments are skipped while it is away (a reconnect brings a new welcome, which voids them anyway),
and every other shard's fragments go on being pushed, merged and applied. A shard that refuses this
learner (its token, its layout) raises like a single syncer does: retrying cannot help.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ddiloco.core import shards
from ddiloco.core.events import Push
from ddiloco.errors import UserError
from ddiloco.net import session
from ddiloco.net.client import ClientConfig, ClientConfigError, ThreadedClient

__all__ = ["MARKERS_OPEN_MAX", "ShardedClient", "ShardsDisagree", "check_welcomes", "merge_welcomes", "split_urls"]

log = logging.getLogger("ddiloco.client")

# Snapshot markers handed to the hook and not answered yet. The hook answers each at the step it
# takes it, so a few are open at most; past this many the oldest is forgotten (its snapshot then
# never completes, which the syncer that started it reports).
MARKERS_OPEN_MAX = 256

Taken = tuple[dict[int, list[session.UpdateInfo]], list[session.ErrorInfo], tuple[int, session.WelcomeInfo | None]]


class ShardsDisagree(UserError, ValueError):
    """The shards' welcomes do not describe one syncer (a URL of another run, a shard started with
    other settings, one shard given twice): the message names the URLs and what differs."""


def split_urls(value: str | Sequence[str]) -> tuple[str, ...]:
    """The syncer URLs of `value`: one URL, several separated by commas, or a sequence of them."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    if any(not isinstance(u, str) for u in parts):
        raise ClientConfigError(f"syncer URLs must be strings, got {value!r}")
    urls = tuple(u.strip() for u in parts)
    if not urls or any(not u for u in urls):
        raise ClientConfigError(f"an empty syncer URL in {value!r}")
    if len(urls) > shards.SHARDS_MAX:
        raise ClientConfigError(f"{len(urls)} syncer URLs, more than the {shards.SHARDS_MAX} shards a syncer may have")
    twice = sorted({u for u in urls if urls.count(u) > 1})
    if twice:
        raise ClientConfigError(f"syncer URL given twice: {', '.join(twice)}")
    return urls


def check_welcomes(welcomes: Sequence[tuple[str, session.WelcomeInfo]]) -> None:
    """Raise ShardsDisagree unless the welcomes, one per URL, are those of the N shards of one syncer."""
    n = len(welcomes)
    first_url, first = welcomes[0]
    seen: dict[int, str] = {}
    for url, w in welcomes:
        if w.shards != n:
            given = "1 syncer URL was" if n == 1 else f"{n} syncer URLs were"
            raise ShardsDisagree(
                f"{url} says it is shard {w.shard} of {w.shards}, but {given} given: give the URL of every shard, each once"
            )
        if w.shard in seen:
            raise ShardsDisagree(f"{url} says it is shard {w.shard} of {n}, as {seen[w.shard]} does")
        seen[w.shard] = url
        _check_same(first_url, first, url, w)


def _check_same(url_a: str, a: session.WelcomeInfo, url_b: str, b: session.WelcomeInfo) -> None:
    """What makes two shards' welcomes those of one syncer: the model and the round schedule."""
    for what, x, y in (
        ("layout digest", a.digest, b.digest),
        ("fragment count", len(a.versions), len(b.versions)),
        ("round period", a.period, b.period),
        ("fragment offsets", a.offsets, b.offsets),
        ("shard count", a.shards, b.shards),
    ):
        if x != y:
            raise ShardsDisagree(f"{url_b} says its {what} is {y}, {url_a} says {x}: they are not shards of one syncer")


def merge_welcomes(by_shard: Sequence[session.WelcomeInfo]) -> session.WelcomeInfo:
    """One welcome for the whole syncer from its shards' (indexed by shard, already checked)."""
    first, n = by_shard[0], len(by_shard)
    count = len(first.versions)
    return session.WelcomeInfo(
        first.learner,
        first.layout,
        first.digest,
        tuple(by_shard[shards.owner(q, n)].versions[q] for q in range(count)),
        max(w.global_step for w in by_shard),
        any(w.needs_init for w in by_shard),
        first.peers,
        first.period,
        first.offsets,
        0,
        n,
        tuple(i for i, w in enumerate(by_shard) if w.needs_init),
    )


@dataclass
class _Link:
    """One shard's client, and what the hook has seen of it."""

    url: str
    client: ThreadedClient
    shard: int = -1  # from its first welcome
    welcome: session.WelcomeInfo | None = None  # the newest handed to the hook
    seen: int = 0  # the client's welcome count as of `welcome`
    # A take that brought a new welcome while another shard's was handed over in the same `take`:
    # handed over (with what came with it) at the next one.
    waiting: Taken | None = None


class ShardedClient:
    """A `learner.transport.Transport` over every shard of a sharded syncer, one client each.
    `configs`: one per shard URL, in any order (the welcomes say which shard is which); `make`
    builds a client (tests inject faults through it)."""

    def __init__(
        self,
        configs: Sequence[ClientConfig],
        make: Callable[[ClientConfig], ThreadedClient] = ThreadedClient,
    ):
        split_urls([c.url for c in configs])  # the count and duplicates, as for a config's URLs
        self._links: list[_Link] = []
        try:
            for c in configs:
                self._links.append(_Link(c.url, make(c)))
        except BaseException:
            self.close()
            raise
        self._by_shard: list[_Link] = []
        self._welcomes = 0  # welcomes handed to the hook: a change tells it a session changed
        self._latest: session.WelcomeInfo | None = None
        self._markers: dict[int, tuple[_Link, int]] = {}  # our id -> (the shard, its snapshot id)
        self._marker_ids = itertools.count(1)
        self.pushes_unsent = 0  # pushes for a shard that was away, or whose new session the hook had not seen
        self._unsent_lock = threading.Lock()  # the count is bumped from the hook's background thread too

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(link.url for link in self._links)

    def wait_welcome(self, timeout_s: float) -> session.WelcomeInfo:
        """Every shard's welcome, checked and merged; TimeoutError naming the shards that did not
        answer within `timeout_s` (all of them waited for at once), a refusal at once."""
        deadline = time.monotonic() + timeout_s
        missing = []
        for link in self._links:
            try:
                link.welcome = link.client.wait_welcome(max(0.0, deadline - time.monotonic()))
            except TimeoutError as exc:
                missing.append(f"{link.url} ({exc})")
                continue
            link.seen = link.client.welcomes_seen
        if missing:
            raise TimeoutError(
                f"no welcome within {timeout_s} s from {len(missing)} syncer shard(s): {'; '.join(missing)}"
            )
        check_welcomes([(link.url, link.welcome) for link in self._links])
        for link in self._links:
            link.shard = link.welcome.shard
        self._by_shard = sorted(self._links, key=lambda link: link.shard)
        self._welcomes = 1
        self._latest = merge_welcomes([link.welcome for link in self._by_shard])
        return self._latest

    def take(self) -> Taken:
        """What every shard sent since the last call; at most one shard's new welcome (see the module)."""
        updates: dict[int, list[session.UpdateInfo]] = {}
        errors: list[session.ErrorInfo] = []
        handed: _Link | None = None
        for link in self._by_shard:
            if link.waiting is not None:
                if handed is not None:
                    continue  # its welcome waits for the next call, and so does everything after it
                got, link.waiting = link.waiting, None
            else:
                got = link.client.take()
                if got[2][0] != link.seen and handed is not None:
                    link.waiting = got
                    continue
            part, errs, (count, welcome) = got
            if count != link.seen:
                assert welcome is not None, "a client counted a welcome it did not hand over"
                _check_same(self._by_shard[0].url, self._by_shard[0].welcome, link.url, welcome)
                if welcome.shard != link.shard:
                    raise ShardsDisagree(
                        f"{link.url} was shard {link.shard} of {len(self._links)} and now says it is shard {welcome.shard}"
                    )
                link.seen, link.welcome, handed = count, welcome, link
                self._welcomes += 1
                self._latest = welcome
            for q, chain in part.items():
                if shards.owner(q, len(self._links)) == link.shard:
                    updates[q] = chain
                else:  # only the owner's versions count (a shard sends none of another's)
                    log.debug("ignoring an update of fragment %d from %s, which does not own it", q, link.url)
            # Which shard complained: the hook logs one list for all of them.
            errors.extend(session.ErrorInfo(e.code, f"{link.url}: {e.text}", e.fatal) for e in errs)
        return updates, errors, (self._welcomes, self._latest)

    def _current(self, link: _Link) -> bool:
        """Whether what the hook sends now may go to this shard: the hook has seen its session."""
        return link.waiting is None

    def progress(self, item: session.ProgressInfo) -> None:
        """To every shard whose fragments the learner all holds (the others' versions held: -1 while
        a shard's fragments are on their way after its restart, sent as 0, which the shard ignores)."""
        whole = all(v >= 0 for v in item.versions)
        sent = item if whole else replace(item, versions=tuple(max(v, 0) for v in item.versions))
        for link in self._by_shard:
            if not self._current(link):
                continue
            if whole or all(item.versions[q] >= 0 for q in link.welcome.owned):
                link.client.progress(sent)

    def holds_report(self, step: int) -> bool:
        """Whether every shard this learner reports to would hold back a report of `step`
        (`ThreadedClient.holds_report`): the hook's calls that only count then make none."""
        return all(link.client.holds_report(step) for link in self._by_shard if self._current(link))

    def push(self, item: Push) -> bool:
        """To the fragment's owner; False when not sent (that shard is away, or its queue is full):
        the hook then pushes that progress with its next push."""
        link = self._by_shard[shards.owner(item.fragment, len(self._links))]
        if not self._current(link) or not link.client.connected:
            with self._unsent_lock:
                self.pushes_unsent += 1
            return False
        return link.client.push(item)

    def sender(self) -> Callable[[Push], bool]:
        """`push` for another thread (ThreadedClient.sender): to the fragment's owner as the hook
        sees the shards now; False when that shard is away or its queue is full."""
        senders = [link.client.sender() if self._current(link) else None for link in self._by_shard]

        def send(item: Push) -> bool:
            shard = shards.owner(item.fragment, len(senders))
            send_to = senders[shard]
            if send_to is None or not self._by_shard[shard].client.connected:
                with self._unsent_lock:
                    self.pushes_unsent += 1
                return False
            return send_to(item)

        return send

    def init(self, fragment: int, payload: bytes) -> None:
        link = self._by_shard[shards.owner(fragment, len(self._links))]
        if self._current(link):
            link.client.init(fragment, payload)

    def watch_updates(self, on_update: Callable[[session.UpdateInfo], None]) -> None:
        """Every shard's client calls `on_update` with each update as it arrives (ThreadedClient)."""
        for link in self._links:
            link.client.watch_updates(on_update)

    def take_markers(self) -> list[int]:
        ours = []
        for link in self._by_shard:
            if not self._current(link):
                continue  # the marker came with a session the hook has not seen: taken with it
            for snapshot in link.client.take_markers():
                mine = next(self._marker_ids)
                self._markers[mine] = (link, snapshot)
                ours.append(mine)
        while len(self._markers) > MARKERS_OPEN_MAX:
            forgotten = next(iter(self._markers))
            link, snapshot = self._markers.pop(forgotten)
            log.warning("snapshot %d of %s was never answered: forgotten", snapshot, link.url)
        return ours

    def local_state(self, snapshot: int, data: bytes) -> None:
        got = self._markers.pop(snapshot, None)
        if got is None:  # forgotten (MARKERS_OPEN_MAX), or never handed out
            log.warning("no open snapshot marker %d: its local state is not sent", snapshot)
            return
        link, theirs = got
        link.client.local_state(theirs, data)

    @property
    def pushes_dropped(self) -> int:
        """Pushes not sent: refused by a client's full queue, or skipped here (`pushes_unsent`)."""
        return self.pushes_unsent + sum(link.client.pushes_dropped for link in self._links)

    def close(self) -> None:
        """Close every shard's client at once (each drains what it has queued, then says goodbye)."""
        closing = [threading.Thread(target=link.client.close, name=f"ddiloco-close-{link.url}") for link in self._links]
        for t in closing:
            t.start()
        for t in closing:
            t.join()
