"""Replay through the real core: a scripted run with a kill and a rejoin, written as a golden tape.

`DDILOCO_REWRITE_GOLDEN=1 pytest tests/core/test_replay.py` rewrites the golden tape and its state
hash on purpose (after a deliberate change of the core's behaviour); otherwise the tape checked in
must replay to the hash stored beside it, and today's core must still produce that run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import orjson
import pytest

from ddiloco.core import codec, replay, syncer
from ddiloco.core import tape as tapes
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import (
    ArmTimer,
    Disconnect,
    InitFragment,
    Join,
    MergeCost,
    Merged,
    Progress,
    Push,
    SendUpdate,
    SendWelcome,
    TimerFired,
)
from ddiloco.core.layout import TensorSpec
from ddiloco.core.vclock import VClock
from ddiloco.net import recording

GOLDEN = Path(__file__).parent / "golden_tapes"
REWRITE = os.environ.get("DDILOCO_REWRITE_GOLDEN") == "1"
TENSORS = (  # 320 parameters in two fragments
    TensorSpec("embed", (16, 8), embedding=True),
    TensorSpec("w", (8, 16)),
    TensorSpec("head", (8, 8)),
)


class ScriptedLearner:
    def __init__(self, name, conn, seed):
        self.name, self.conn = name, conn
        self.id = None
        self.rng = np.random.default_rng(seed)
        self.clock = VClock()
        self.step = 0
        self.versions = [-1, -1]
        self.received_at = [0, 0]

    def send(self):
        self.clock = self.clock.tick(self.name)
        return self.clock


class ScriptedRun:
    """The real core, driven by scripted learners on a virtual clock, every event taped."""

    def __init__(self, directory, state=None, options=tapes.TapeOptions(), config=None):
        self.state = state or syncer.new_state(config or SyncerConfig(num_fragments=2, period=2))
        self.writer = recording.TapeWriter.create(directory, self.state, "scripted", options)
        self.now, self.clock = 0.0, VClock()
        self.learners: dict[int, ScriptedLearner] = {}
        self.due, self.timers = [], []  # (learner, fragment) pushes due; timers armed
        self.merges = 0

    def send(self, event, dt=0.001, sender=None):
        self.now = round(self.now + dt, 6)
        carried = sender.send() if sender else VClock()
        self.clock = self.clock.merge(carried).tick("syncer")
        index = self.writer.event(event, self.now, self.clock)
        self.state, effects = syncer.handle(self.state, event, self.now)
        self.writer.checks(index, self.state, effects)
        self._carry_out(effects, sender)
        return effects

    def _carry_out(self, effects, sender):
        for e in effects:
            if isinstance(e, SendWelcome):
                sender.id = e.learner
                self.learners[e.learner] = sender
                if e.needs_init:
                    for f in self.state.layout.fragments:
                        if not self.state.owns(f.index):  # a shard's learner sends it its own fragments
                            continue
                        vec = sender.rng.standard_normal(f.padded_size).astype(np.float32)
                        self.send(
                            InitFragment(e.learner, f.index, codec.parse(codec.encode(vec, "fp32"))), sender=sender
                        )
                    sender.versions = [0, 0]
            elif isinstance(e, SendUpdate):
                for m in e.learners:
                    lr = self.learners[m]
                    lr.versions[e.fragment] = self.state.fragments[e.fragment].version
                    lr.received_at[e.fragment] = lr.step
                    lr.clock = lr.clock.merge(self.clock)
            elif isinstance(e, ArmTimer):
                self.timers.append(e)
        if any(isinstance(e, Merged) for e in effects):
            self.merges += 1
            self.send(MergeCost(0.0005), dt=0.0)

    def join(self, name, conn, seed):
        lr = ScriptedLearner(name, conn, seed)
        self.send(Join(conn, name, TENSORS, syncer.PROTOCOL_VERSION), sender=lr)
        return lr

    def step(self, lr, tokens=64):
        lr.step += 1
        steps = tuple(lr.step - r for r in lr.received_at)
        self.send(Progress(lr.id, lr.step, tuple(lr.versions), steps, tuple(s * tokens for s in steps)), sender=lr)
        if min(lr.versions) >= 0:  # the welcome's schedule: fragment p at steps t mod H == t_p (protocol 2)
            self.due += [(lr, p) for p in self.state.schedule.due(lr.step)]

    def answer(self, gone=()):
        """The learners push the fragments due at their last step."""
        pending, self.due = self.due, []
        for lr, p in pending:
            if lr.id in gone or not self.state.owns(p):
                continue
            size = self.state.layout.fragments[p].padded_size
            vec = (lr.rng.standard_normal(size) * 0.01).astype(np.float32)
            steps = lr.step - lr.received_at[p]
            payload = codec.parse(codec.encode(vec, "int4"))
            self.send(Push(lr.id, p, lr.step, lr.versions[p], steps, steps * 64, payload), sender=lr)

    def fire_timers(self):
        due = [t for t in self.timers if t.at <= self.now]
        self.timers = [t for t in self.timers if t.at > self.now]
        for t in due:
            self.send(TimerFired(t.fragment, t.round), dt=0.0)

    def close(self):
        self.writer.close(self.state)
        return syncer.state_hash(self.state)


def scripted_run(directory, options=tapes.TapeOptions()) -> tuple[str, int]:
    """Two learners, b killed at step 5 and back (a new process, same name) at step 8; 12 steps.
    Plain mean merges: RDA's norms are sums whose last bits may depend on the CPU's vector width
    (kernels/_segments.py), and a golden file must hold on every machine. Same-machine replay of
    RDA runs is checked by the other tests here and in tests/net/test_record.py."""
    run = ScriptedRun(directory, options=options, config=SyncerConfig(num_fragments=2, period=2, merge="mean"))
    a = run.join("a", 1, seed=1)
    b = run.join("b", 2, seed=2)
    gone = set()
    for t in range(1, 13):
        if t == 5:
            run.send(Disconnect(b.id, "killed"), sender=None)
            gone.add(b.id)
        if t == 8:
            b = run.join("b", 3, seed=3)
        for lr in (a, b):
            if lr.id not in gone:
                run.step(lr)
        run.answer(gone)
        run.now = round(run.now + 0.05, 6)
        run.fire_timers()
    return run.close(), run.merges


def _golden_hash(name):
    return orjson.loads((GOLDEN / name / "expected.json").read_bytes())["state_hash"]


def test_golden_tape_replays_to_its_known_state_hash(tmp_path):
    directory = GOLDEN / "kill_rejoin"
    if REWRITE:
        shutil.rmtree(directory, ignore_errors=True)
        final, merges = scripted_run(directory)
        (directory / "expected.json").write_bytes(
            orjson.dumps({"state_hash": final, "merges": merges}, option=orjson.OPT_INDENT_2)
        )
    result = replay.replay(recording.read(directory))
    assert result.ok, result.divergence
    assert result.final_checked
    assert result.state_hash == _golden_hash("kill_rejoin")
    assert result.merges_checked >= 6
    # Today's core must still produce the recorded run (else: rewrite the golden tape on purpose).
    final, _ = scripted_run(tmp_path / "today")
    assert final == _golden_hash("kill_rejoin")


def test_golden_tape_has_the_kill_the_rejoin_and_the_timers():
    tape = recording.read(GOLDEN / "kill_rejoin")
    kinds = [r["kind"] for r in tape.events]
    assert {"Join", "InitFragment", "Progress", "Push", "Disconnect", "MergeCost"} <= set(kinds)
    assert kinds.count("Join") == 3
    clocks = [r["clock"]["syncer"] for r in tape.events]
    assert clocks == list(range(1, len(clocks) + 1))  # the syncer ticks once per event
    assert any("b" in r["clock"] for r in tape.events)


def _copy_golden(tmp_path):
    target = tmp_path / "tape"
    shutil.copytree(GOLDEN / "kill_rejoin", target)
    return target


def _rewritten(tmp_path, directory, records):
    out = tmp_path / "rewritten" / tapes.TAPE_FILE
    out.parent.mkdir(parents=True)
    shutil.copytree(directory / tapes.PAYLOAD_DIR, out.parent / tapes.PAYLOAD_DIR)
    with open(out, "wb") as fh:
        fh.write(tapes.preamble(tapes.MAGIC))
        fh.writelines(tapes.framed(r) for r in records)
    return recording.read(out.parent)


def test_a_tampered_payload_is_a_divergence_naming_the_event(tmp_path):
    directory = _copy_golden(tmp_path)
    tape = recording.read(directory)
    push = next(r for r in tape.events if r["kind"] == "Push")
    sha = push["fields"]["payload"]["$payload"]["sha256"]
    path = directory / tapes.PAYLOAD_DIR / sha
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x11
    path.write_bytes(bytes(raw))
    result = replay.replay(recording.read(directory))
    assert not result.ok
    d = result.divergence
    assert d.index == push["i"] and "Push" in d.event and d.what == "payload hash" and d.expected == sha


def test_an_edited_push_diverges_at_a_later_merge_or_the_end(tmp_path):
    # Rewrite one push's token count (a well-formed tape of a different run): replay must
    # notice that the recorded checks do not follow from these inputs.
    directory = _copy_golden(tmp_path)
    tape = recording.read(directory)
    first_push = next(r for r in tape.events if r["kind"] == "Push")
    records = [tape.header] + tape.records + [tape.close]
    pushed = next(r for r in tape.events if r["kind"] == "Push" and r is not first_push)
    pushed["fields"]["tokens"] += 1000  # more weight: different merged values
    result = replay.replay(_rewritten(tmp_path, directory, records))
    assert not result.ok
    assert result.divergence.index >= pushed["i"]
    assert "expected" in str(result.divergence)


def test_a_tape_without_payloads_says_it_cannot_be_replayed(tmp_path):
    scripted_run(tmp_path / "t", tapes.TapeOptions(keep_payloads=False))
    assert not any((tmp_path / "t" / tapes.PAYLOAD_DIR).iterdir())
    with pytest.raises(tapes.TapeError, match="without payloads"):
        replay.replay(recording.read(tmp_path / "t"))


def test_a_run_cut_short_replays_what_was_recorded(tmp_path):
    # A syncer killed mid-run: no close record, the tail torn inside a record.
    directory = _copy_golden(tmp_path)
    path = directory / tapes.TAPE_FILE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    result = replay.replay(recording.read(directory))
    assert result.ok, result.divergence
    assert result.torn and not result.final_checked and result.merges_checked > 0


def test_a_run_killed_between_an_event_and_its_checks_replays_and_a_clean_one_does_not(tmp_path):
    # A syncer killed after it wrote an event that merged and before it wrote the merge's check:
    # whole records, no close record. The missing check is what the kill lost, not a divergence.
    directory = _copy_golden(tmp_path)
    tape = recording.read(directory)
    last_check = max(i for i, r in enumerate(tape.records) if r["type"] == "check")
    first_of_event = last_check
    while tape.records[first_of_event - 1]["type"] == "check":
        first_of_event -= 1
    records = [tape.header] + tape.records[:first_of_event]
    result = replay.replay(_rewritten(tmp_path, directory, records))
    assert result.ok, result.divergence
    assert not result.torn and not result.final_checked
    # The same tape with a close record claims a clean end: the merge without its check diverges.
    closed = dict(tape.close, events=sum(1 for r in records[1:] if r["type"] != "check"))
    result = replay.replay(_rewritten(tmp_path / "closed", directory, records + [closed]))
    assert not result.ok and result.divergence.expected == "no merge"


def test_a_run_resumed_from_a_checkpoint_replays_from_it(tmp_path):
    from ddiloco.core import checkpoint

    first = ScriptedRun(tmp_path / "first")
    a = first.join("a", 1, seed=1)
    for _ in range(4):
        first.step(a)
        first.answer()
    first.close()
    resumed = checkpoint.restore(b"".join(bytes(c) for c in checkpoint.to_chunks(first.state)))
    second = ScriptedRun(tmp_path / "second", state=resumed)
    a = second.join("a", 1, seed=4)
    for _ in range(6):
        second.step(a)
        second.answer()
    final = second.close()
    tape = recording.read(tmp_path / "second")
    assert tape.header["start"]["kind"] == "checkpoint"
    result = replay.replay(tape)
    assert result.ok, result.divergence
    assert result.state_hash == final and result.merges_checked > 0


def test_a_shards_run_and_a_run_resumed_from_its_checkpoint_replay(tmp_path):
    """A shard's tape records its config (shard 1 of 2): replay builds the same shard, which merges
    only fragment 1; a shard's checkpoint starts a tape as any checkpoint does."""
    from ddiloco.core import checkpoint

    config = SyncerConfig(num_fragments=2, period=2, shard=1, shards=2)
    first = ScriptedRun(tmp_path / "first", config=config)
    a = first.join("a", 1, seed=1)
    b = first.join("b", 2, seed=2)
    for _ in range(6):
        for lr in (a, b):
            first.step(lr)
        first.answer()
        first.now = round(first.now + 0.05, 6)
        first.fire_timers()
    final = first.close()
    assert first.state.fragments[1].version > 0 and first.state.fragments[0].theta is None
    tape = recording.read(tmp_path / "first")
    assert (tape.header["config"]["shard"], tape.header["config"]["shards"]) == (1, 2)
    result = replay.replay(tape)
    assert result.ok, result.divergence
    assert result.state_hash == final and result.merges_checked == first.state.fragments[1].version

    resumed = checkpoint.restore(b"".join(bytes(c) for c in checkpoint.to_chunks(first.state)))
    second = ScriptedRun(tmp_path / "second", state=resumed)
    a = second.join("a", 1, seed=4)
    a.versions[0] = 0  # what it holds of fragment 0 came from shard 0
    a.step = second.state.global_step  # a learner joining counts from the welcome's global step
    for _ in range(6):
        second.step(a)
        second.answer()
    final = second.close()
    tape = recording.read(tmp_path / "second")
    assert tape.header["start"]["kind"] == "checkpoint"
    result = replay.replay(tape)
    assert result.ok, result.divergence
    assert result.state_hash == final and result.merges_checked > 0
