"""`ddiloco replay DIR --full`: re-execute a whole recorded demo in one process, bit for bit.

A recording (`ddiloco demo --record DIR`) holds the syncer's tape(s) (`syncer/`, and `syncer.2/`...
after a syncer restart) and one tape per learner incarnation (`learners/<name>.<n>/`, learner.tape).
The syncer's tapes name pushed payloads by hash only: they are regenerated here.

1. Every learner incarnation is trained again by the same code (`demo.learner_process.run_learner`) from its
   recorded configuration and seed, with a stand-in for the network that hands the sync hook, at the
   same call, what the live run's hook took (fragment versions, errors, welcomes), and a
   stand-in for the peers that gives back the state it recovered. Each push, initial fragment and
   published snapshot it makes must hash as recorded, and at a clean end its final parameters too.
2. The syncer's core replays its tape(s) (core.replay) with the push and init payloads from step 1:
   every merge and the final state hash, that is the final merged parameters, must be bit-identical.
3. Every fragment version a learner applied must be one the syncer's replay produced (checked by
   hash when broadcasts are fp32, whose body is the fragment's values).

The first difference is reported, naming the learner and the call of its sync hook, or the syncer's
event. Reproduction assumes the same machine kind and library versions as the recording (XLA's
kernels may differ across CPUs; docs/replay.md).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ddiloco.core import replay as core_replay
from ddiloco.core import tape as tapes
from ddiloco.core.events import Push
from ddiloco.learner import recovery
from ddiloco.learner import tape as ltapes
from ddiloco.net import peer, recording, session

log = logging.getLogger("ddiloco.replay")

LEARNERS_DIR = "learners"
SYNCER_DIR = "syncer"


@dataclass
class LearnerResult:
    name: str
    calls: int
    pushes: int
    inits: int
    published: int
    final_checked: bool
    divergence: str | None = None
    init_bodies: list = field(default_factory=list)  # (fragment, sha256 of the body) of each initial fragment sent


@dataclass
class FullResult:
    learners: list[LearnerResult] = field(default_factory=list)
    syncers: list[tuple[str, core_replay.ReplayResult]] = field(default_factory=list)
    updates_checked: int = 0
    updates_note: str = ""
    divergence: str | None = None
    init_bodies: list = field(default_factory=list)
    # Incarnations stopped before the syncer welcomed them (a restart cut short by the end of the
    # run): they sent nothing, so nothing of the run depends on them and there is nothing to re-execute.
    never_joined: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.divergence is None

    @property
    def state_hash(self) -> str | None:
        return self.syncers[-1][1].state_hash if self.syncers else None


class _Transport:
    """Stands in for `ThreadedClient` (a learner.transport.Transport): what the live hook took, call
    by call; what it sends, kept."""

    def __init__(self, tape: ltapes.LearnerTape):
        self.first = tape.welcome()
        self.takes = tape.takes()
        self.calls = 0
        self.welcomes, self.current = 1, self.first
        self.pushes: list[tuple[int, Push]] = []
        # the pushes the live transport did not send, by their order: the replay refuses them too
        self.dropped = tape.dropped_pushes()
        self.inits: list[tuple[int, int, bytes]] = []
        self.refused = None

    def wait_welcome(self, timeout_s: float) -> session.WelcomeInfo:
        return self.first

    def take(self) -> tuple[dict, list, tuple[int, session.WelcomeInfo | None]]:
        self.calls += 1
        taken = self.takes.get(self.calls)
        if taken is None:
            return {}, [], (self.welcomes, self.current)
        welcomes, welcome = taken[2]
        if welcome is not None:
            self.welcomes, self.current = welcomes, welcome
        return taken[0], taken[1], (self.welcomes, self.current)

    def progress(self, item: session.ProgressInfo) -> None:
        pass  # the syncer's tape has the progress it received

    def push(self, item: Push) -> bool:
        self.pushes.append((self.calls, item))
        return len(self.pushes) - 1 not in self.dropped

    def init(self, fragment: int, payload: bytes) -> None:
        self.inits.append((self.calls, fragment, payload))

    def take_markers(self) -> list[int]:
        return []  # a consistent snapshot's local state changes nothing the run computes: not replayed

    def local_state(self, snapshot: int, data: bytes) -> None:
        raise AssertionError("the replay hands out no snapshot markers, so no local state is sent")

    def close(self) -> None:
        pass


class _Snapshots:
    """Stands in for the peer server's box: wanted exactly at the calls the live run published."""

    def __init__(self, transport: _Transport, published: list[dict]):
        self.transport = transport
        self.recorded = {r["call"]: r["sha256"] for r in published}
        self.got: dict[int, str] = {}

    @property
    def wanted(self) -> bool:
        return self.transport.calls in self.recorded and self.transport.calls not in self.got

    def publish(self, data: bytes) -> None:
        self.got[self.transport.calls] = ltapes.sha256(data)


class LearnerReplay:
    """What `run_learner(cfg, replay=...)` needs to re-execute one recorded incarnation."""

    def __init__(self, tape: ltapes.LearnerTape):
        self.tape = tape
        self.transport = _Transport(tape)
        self.snapshots = _Snapshots(self.transport, tape.of("publish"))
        self.params_sha256: str | None = None
        self.calls = 0

    def sync_arguments(self) -> dict:
        return {"transport": self.transport, "recover_fn": self._recover, "snapshots": self.snapshots}

    def done(self, calls: int) -> bool:
        return calls >= self.tape.last_call

    def finished(self, sync: Any, params: Any) -> None:
        self.params_sha256, self.calls = sync.params_sha256(params), sync.calls

    def _recover(self, welcome: session.WelcomeInfo, params: Any, opt_state: Any, *_: Any) -> recovery.Recovered:
        recorded = self.tape.of("recover")
        if not recorded:
            raise ltapes.LearnerTapeError(
                f"{self.tape.directory.name}: the replayed learner recovers, the recorded one did not"
            )
        r = recorded[0]
        if r["snapshot"] is None:
            return recovery.Recovered(params, opt_state, welcome.global_step, (), r["source"], 0.0)
        snap = peer.decode_snapshot(self.tape.snapshot(r["snapshot"]))
        new_params, new_opt, step, versions = recovery.adopt(
            snap, params, opt_state, welcome.digest, tuple(welcome.versions)
        )
        return recovery.Recovered(new_params, new_opt, step, versions, r["source"], 0.0)


def replay_learner(tape: ltapes.LearnerTape, cache_dir: Path | None = None) -> tuple[LearnerResult, dict[str, bytes]]:
    """Re-execute one incarnation; (result, payload body by sha256 for every push and init it made)."""
    from ddiloco.demo.learner_process import learner_config_from_json, run_learner

    cfg = replace(learner_config_from_json(tape.config), cache_dir=cache_dir, speed=1.0)  # speed only sleeps
    rep = LearnerReplay(tape)
    run_learner(cfg, replay=rep)
    name = tape.directory.name
    result = LearnerResult(
        name,
        rep.calls,
        len(rep.transport.pushes),
        len(rep.transport.inits),
        len(rep.snapshots.got),
        tape.closed is not None,
    )
    result.divergence = _learner_divergence(tape, rep)
    bodies = {}
    for _, push in rep.transport.pushes:
        body = bytes(push.payload.body)
        bodies[ltapes.sha256(body)] = body
    for _, q, payload in rep.transport.inits:
        body = ltapes.payload_body(payload)
        bodies[ltapes.sha256(body)] = body
        result.init_bodies.append((q, ltapes.sha256(body)))
    return result, bodies


def _learner_divergence(tape: ltapes.LearnerTape, rep: LearnerReplay) -> str | None:
    """The first difference between what the live incarnation sent and what the replay sent."""
    torn = tape.closed is None
    got_pushes = [
        {
            "call": c,
            "fragment": p.fragment,
            "step": p.step,
            "base_version": p.base_version,
            "steps": p.steps,
            "tokens": p.tokens,
            "sha256": ltapes.payload_sha256(p.payload),
        }
        for c, p in rep.transport.pushes
    ]
    got_inits = [{"call": c, "fragment": q, "sha256": ltapes.sha256(b)} for c, q, b in rep.transport.inits]
    for kind, got in (("push", got_pushes), ("init", got_inits)):
        want = [{k: v for k, v in r.items() if k != "type"} for r in tape.of(kind)]
        for i, w in enumerate(want):
            if i >= len(got):
                return f"call {w['call']}: the recorded {kind} of fragment {w['fragment']} was not made again"
            if got[i] != w:
                diff = sorted(k for k in w if got[i].get(k) != w[k])
                return (
                    f"call {w['call']}: {kind} {i} of fragment {w['fragment']} differs in {diff}: "
                    f"expected {[w[k] for k in diff]}, got {[got[i][k] for k in diff]}"
                )
        # A killed learner may have made (and not yet recorded) more in its last call, never earlier.
        extra = [g for g in got[len(want) :] if not (torn and g["call"] == tape.last_call)]
        if extra:
            return f"call {extra[0]['call']}: the replay made a {kind} of fragment {extra[0]['fragment']} the recorded run did not"
    for call, sha in rep.snapshots.recorded.items():
        if rep.snapshots.got.get(call) != sha:
            return f"call {call}: the snapshot published for a peer hashes {str(rep.snapshots.got.get(call))[:16]}, recorded {sha[:16]}"
    closed = tape.closed
    if closed is not None:
        if closed["calls"] != rep.calls:
            return f"the recorded run ended after {closed['calls']} calls, the replay after {rep.calls}"
        if closed["params_sha256"] != rep.params_sha256:
            return f"final parameters hash {str(rep.params_sha256)[:16]}, recorded {closed['params_sha256'][:16]}"
    return None


def learner_tapes(directory: Path) -> list[ltapes.LearnerTape]:
    root = Path(directory) / LEARNERS_DIR
    dirs = sorted(p for p in root.glob("*") if (p / ltapes.TAPE_FILE).exists()) if root.is_dir() else []
    return [ltapes.read(d) for d in dirs]


def syncer_tape_dirs(directory: Path) -> list[Path]:
    """syncer/, syncer.2/, ... in the order the syncer started."""
    found = [p for p in Path(directory).glob(f"{SYNCER_DIR}*") if (p / tapes.TAPE_FILE).exists()]
    return sorted(found, key=lambda p: int(p.name.split(".")[1]) if "." in p.name else 1)


def replay_full(directory: Path | str, cache_dir: Path | None = None) -> FullResult:
    """Steps 1-3 of the module docstring. TapeError when the recording itself cannot be used."""
    directory = Path(directory)
    syncer_dirs = syncer_tape_dirs(directory)
    learners = learner_tapes(directory)
    if not syncer_dirs or not learners:
        raise tapes.TapeError(
            f"{directory} is not a recorded demo: it needs {SYNCER_DIR}/ and {LEARNERS_DIR}/*/ tapes "
            "(written by `ddiloco demo --record DIR`)"
        )
    out = FullResult()
    out.never_joined = [t.directory.name for t in learners if not t.of("welcome")]
    learners = [t for t in learners if t.of("welcome")]
    bodies: dict[str, bytes] = {}
    for tape in learners:
        log.info("re-executing learner %s (%d calls)", tape.directory.name, tape.last_call)
        result, made = replay_learner(tape, cache_dir)
        out.learners.append(result)
        out.init_bodies += result.init_bodies
        bodies.update(made)
        if result.divergence and out.divergence is None:
            out.divergence = f"learner {result.name}: {result.divergence}"
    checks: dict[tuple[int, int], set[str]] = {}
    for d in syncer_dirs:
        tape = dataclasses.replace(recording.read(d), payloads=bodies)
        result = core_replay.replay(tape)
        out.syncers.append((d.name, result))
        for r in tape.records:
            if r["type"] == "check":
                # a whole update is the published copy, a delta its codec body (docs/protocol.md)
                checks.setdefault((r["fragment"], r["version"]), set()).update(
                    r[k] for k in ("published", "delta") if k in r
                )
        if not result.ok and out.divergence is None:
            out.divergence = f"syncer tape {d.name}: {result.divergence}"
    for q, sha in out.init_bodies:  # version 0 of a fragment is what the first learner sent
        checks.setdefault((q, 0), set()).add(sha)
    out.updates_checked, bad = _check_updates(learners, checks)
    if bad and out.divergence is None:
        out.divergence = bad
    return out


def _check_updates(learners: list[ltapes.LearnerTape], checks: dict) -> tuple[int, str | None]:
    """Every fragment version a learner applied came out of the syncer's (replayed) core."""
    n = 0
    for tape in learners:
        for r in tape.of("take"):
            for q, version, ref, *_ in r["updates"]:
                sha = ref["$payload"]["sha256"]
                if sha not in checks.get((q, version), set()):
                    return n, (
                        f"learner {tape.directory.name}: call {r['call']}: applied fragment {q} version {version} "
                        f"({sha[:16]}), which the syncer's replay never produced"
                    )
                n += 1
    return n, None
