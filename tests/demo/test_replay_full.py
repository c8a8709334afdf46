"""`ddiloco replay --full`: a recorded run with a learner killed and rejoining from a live peer is
re-executed in one process (real syncer and learner processes on 127.0.0.1 for the recording) and
reproduces every push, the peer's snapshot and the final merged parameters bit for bit; a learner
tape that does not fit its run is named by the first push that differs."""

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from ddiloco.core import tape as tapes
from ddiloco.demo import replay as full
from ddiloco.learner import tape as ltapes
from ddiloco.net import recording as recordings
from ddiloco.net.auth import write_token_file

TOKEN = "replay-full-token-0123456789"
DEADLINE_S = 180


def _status(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as r:
        return json.loads(r.read())


def _wait(what, fn):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {DEADLINE_S} s")


def _syncer(tmp_path, rec):
    log = tmp_path / "syncer.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ddiloco.cli",
                "syncer",
                "--port",
                "0",
                "--auth-token-file",
                str(tmp_path / "token"),
                "--checkpoint-dir",
                str(tmp_path / "ck"),
                "--fragments",
                "2",
                "--period",
                "4",
                "--overlap",
                "2",
                "--quorum",
                "1",
                "--outer-lr",
                "1.0",
                "--outer-momentum",
                "0.0",
                "--grace-max-ms",
                "200",
                "--record",
                str(rec / "syncer"),
                "--record-no-payloads",
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    found = _wait("listening syncer", lambda: re.search(r"listening on 127\.0\.0\.1:(\d+)", log.read_text()))
    return proc, int(found.group(1))


def _learner(tmp_path, rec, port, name, shard, seed, steps, cache_dir, speed=1.0):
    log = open(tmp_path / f"{name}.log", "a")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddiloco.cli",
            "learner",
            "--syncer",
            f"ws://127.0.0.1:{port}/ws",
            "--token-file",
            str(tmp_path / "token"),
            "--shard",
            shard,
            "--name",
            name.split(".")[0],
            "--steps",
            str(steps),
            "--batch",
            "2",
            "--seed",
            str(seed),
            "--speed",
            str(speed),
            "--cache-dir",
            str(cache_dir),
            "--record",
            str(rec / "learners" / name),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    log.close()
    return proc


def _live(port, name, not_id=None):
    return [
        r["id"] for r in _status(port)["learners"] if r["name"] == name and r["status"] == "live" and r["id"] != not_id
    ]


def _merged_of(port, learner_id):
    """Tokens of the learner's pushes merged so far (on time or late)."""
    (r,) = [r for r in _status(port)["learners"] if r["id"] == learner_id]
    pushed = r.get("pushed_tokens", {})
    return pushed.get("merged", 0) + pushed.get("merged_late", 0)


def _step(port, learner_id):
    return next(r["step"] for r in _status(port)["learners"] if r["id"] == learner_id)


@pytest.fixture(scope="module")
def recording(tmp_path_factory, jax_cache_dir):
    tmp_path = tmp_path_factory.mktemp("replay-full")
    write_token_file(tmp_path / "token", TOKEN)
    rec = tmp_path / "rec"
    syncer, port = _syncer(tmp_path, rec)
    procs = []
    try:
        # a: the peer, slow so that it is still training when b comes back; b: killed and restarted.
        procs.append(_learner(tmp_path, rec, port, "a.0", "0/2", 1, 10**6, jax_cache_dir, speed=0.3))
        b = _learner(tmp_path, rec, port, "b.0", "1/2", 2, 10**6, jax_cache_dir)
        procs.append(b)
        first_b = _wait("live learner b", lambda: _live(port, "b"))[0]
        # b is killed after a push of its was merged: the replay checks every learner's pushes, and on
        # a loaded machine three merges could all be a's while b still compiled.
        _wait("three merges, one with b's push", lambda: _status(port)["merges"] >= 3 and _merged_of(port, first_b))
        b.send_signal(signal.SIGKILL)
        b.wait(30)
        # b.1 copies a's step, which runs on while b.1 compiles: it trains until told to stop.
        b1 = _learner(tmp_path, rec, port, "b.1", "1/2", 3, 10**6, jax_cache_dir)
        procs.append(b1)
        (b1_id,) = _wait("b rejoined", lambda: _live(port, "b", not_id=first_b))
        rejoined_at = _step(port, b1_id)
        _wait("24 steps of b after rejoining", lambda: _step(port, b1_id) >= rejoined_at + 24)
        b1.send_signal(signal.SIGTERM)
        assert b1.wait(60) == 0, (tmp_path / "b.1.log").read_text()[-3000:]
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(60) == 0, (tmp_path / "a.0.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        syncer.send_signal(signal.SIGTERM)
        syncer.wait(60)
    return rec


def test_a_run_with_a_kill_and_a_peer_recovery_replays_bit_for_bit(recording, jax_cache_dir):
    rec = recording
    b1 = ltapes.read(rec / "learners" / "b.1")
    (recovered,) = b1.of("recover")
    assert recovered["source"].startswith("peer") and recovered["snapshot"], "b.1 should copy a's state"
    assert ltapes.read(rec / "learners" / "a.0").of("publish"), "a served its state to b.1"
    # The syncer's tape names pushes by hash only: nothing but re-executing the learners gives them back.
    assert not recordings.read(rec / "syncer").header["keep_payloads"]

    # A restart cut short by the end of the run: its tape has a header and nothing else.
    ltapes.LearnerTapeWriter.create(rec / "learners" / "c.0", ltapes.read(rec / "learners" / "b.1").config).abandon()

    result = full.replay_full(rec, cache_dir=jax_cache_dir)

    assert result.ok, result.divergence
    assert result.never_joined == ["c.0"]
    by_name = {r.name: r for r in result.learners}
    assert set(by_name) == {"a.0", "b.0", "b.1"}
    assert by_name["a.0"].published >= 1 and by_name["a.0"].final_checked and by_name["b.1"].final_checked
    assert not by_name["b.0"].final_checked  # SIGKILLed: its pushes are checked, not its end
    assert all(r.pushes > 0 for r in result.learners)
    ((_, syncer),) = result.syncers
    assert syncer.final_checked and syncer.merges_checked >= 3  # the final merged parameters, bit for bit
    assert result.updates_checked > 0


def test_a_learner_tape_that_does_not_fit_its_run_is_named_by_the_first_push(recording, tmp_path, jax_cache_dir):
    rec = recording
    tape = ltapes.read(rec / "learners" / "a.0")
    # The same tape with another data seed: the first outer gradient it pushes differs.
    copy = ltapes.LearnerTapeWriter.create(tmp_path / "a.0", {**tape.config, "seed": tape.config["seed"] + 1})
    for record in tape.records:
        copy._append(record)
    for payload in (rec / "learners" / "a.0" / tapes.PAYLOAD_DIR).iterdir():
        (tmp_path / "a.0" / tapes.PAYLOAD_DIR / payload.name).write_bytes(payload.read_bytes())
    copy.abandon()

    result, _ = full.replay_learner(ltapes.read(tmp_path / "a.0"), jax_cache_dir)

    first_push = tape.of("push")[0]
    assert result.divergence is not None
    assert result.divergence.startswith(f"call {first_push['call']}: push 0 of fragment {first_push['fragment']}"), (
        result.divergence
    )
    assert "sha256" in result.divergence


def test_a_recording_without_learner_tapes_is_refused_with_what_is_missing(tmp_path):
    with pytest.raises(tapes.TapeError, match="not a recorded demo"):
        full.replay_full(tmp_path)


def test_a_config_from_another_version_is_a_clear_error():
    from ddiloco.demo.learner_process import learner_config_from_json

    with pytest.raises(ValueError, match="does not fit this version"):
        learner_config_from_json({"syncer": "ws://x/ws"})


def test_a_fragment_pushed_twice_in_one_call_is_refused_in_the_replay_only_where_the_live_run_dropped_it(tmp_path):
    """A graceful close pushes the rest at the call of the last step, which may have pushed the same
    fragment: the live transport sent the first push and refused the second (a full queue), and the
    replay's transport does exactly that (a refusal named by call and fragment took both)."""
    import numpy as np

    from ddiloco.core import codec
    from ddiloco.core.events import Push
    from ddiloco.net import session

    writer = ltapes.LearnerTapeWriter.create(tmp_path / "a.0", {})
    writer.welcome(1, session.WelcomeInfo(1, {}, "ab" * 32, (5, 5, 5, 5), 0, False, period=4, offsets=(0, 1, 2, 3)))
    payload = codec.parse(codec.encode(np.ones(64, np.float32), "fp32"))
    last_step, at_close = Push(1, 2, 90, 5, 12, 3072, payload), Push(1, 2, 91, 5, 13, 3328, payload)
    writer.push(88, last_step)
    writer.push(88, at_close)
    writer.dropped(88, 2)
    writer.close(88, 91, "0" * 64)
    tape = ltapes.read(tmp_path / "a.0")
    assert tape.dropped_pushes() == {1}

    transport = full._Transport(tape)
    transport.calls = 88
    assert transport.push(last_step) is True
    assert transport.push(at_close) is False


def test_a_dropped_record_before_any_push_is_a_clear_error(tmp_path):
    writer = ltapes.LearnerTapeWriter.create(tmp_path / "a.0", {})
    writer.dropped(3, 0)
    writer.close(3, 3, "0" * 64)
    with pytest.raises(ltapes.LearnerTapeError, match="dropped push at call 3 before any push"):
        ltapes.read(tmp_path / "a.0").dropped_pushes()
