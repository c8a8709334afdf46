"""The demo's live view: what it says of a learner that has not joined yet, and plain lines that are
shortened at word boundaries, never mid-word."""

import io

import pytest

from ddiloco.demo.config import DemoConfig
from ddiloco.demo.live_view import DECISION_CHARS_MAX, PlainView, fit_words, learner_rows
from ddiloco.demo.supervisor import LearnerProcess, LossLog, SyncerProcess

REASON = "merged 3/4 (quorum 1) after 120 ms of grace; learner 2 late by 35 ms, learner 3 stale (base 4 < 5)"


@pytest.mark.parametrize("width", range(len("merged ..."), len(REASON) + 2))  # from where one word fits
def test_fit_words_cuts_only_at_word_boundaries(width):
    got = fit_words(REASON, width)
    assert len(got) <= width
    if len(REASON) <= width:
        assert got == REASON
    else:
        assert got.endswith(" ...")
        kept = got.removesuffix(" ...").split(" ")
        assert kept == REASON.split(" ")[: len(kept)]  # whole words, in order, none cut


def test_fit_words_cuts_a_single_word_longer_than_the_width_rather_than_show_nothing():
    assert fit_words("x" * 30, 10) == "x" * 7 + "..."


def _log(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    log = LossLog(path)
    log.read()
    return log


def test_a_learner_compiling_its_step_shows_compiling_then_joining_then_the_syncers_word(tmp_path):
    cfg = DemoConfig(learners=3)
    learners = [LearnerProcess(0), LearnerProcess(1), LearnerProcess(2)]
    logs = [
        _log(tmp_path, "0.jsonl", '{"phase": "compiling"}\n'),
        _log(tmp_path, "1.jsonl", '{"phase": "compiling"}\n{"phase": "compiled", "seconds": 21.5}\n'),
        _log(
            tmp_path,
            "2.jsonl",
            '{"phase": "compiling"}\n{"phase": "compiled", "seconds": 21.5}\n{"step": 5, "loss": 3.25}\n',
        ),
    ]
    assert [log.phase for log in logs] == ["compiling", "compiled", "training"] and logs[2].points == [(5, 3.25)]
    assert not any(log.torn for log in logs)  # phase lines are not torn step lines
    status = {
        "global_step": 5,
        "merges": 1,
        "fragments": [{"version": 1}],
        "learners": [{"id": 1, "name": "learner-2", "status": "live", "step": 5, "versions": [1]}],
        "decisions": [{"reason": REASON}],
    }
    rows = learner_rows(status, learners, logs, cfg)
    assert [r["state"] for r in rows] == ["compiling", "joining", "live"]

    # Restarted: its process compiles again while the syncer still lists the killed one.
    logs[2].phase = "starting"  # what the supervisor sets when it spawns the new process
    assert learner_rows(status, learners, logs, cfg)[2]["state"] == "starting"
    logs[2].path.write_text(logs[2].path.read_text() + '{"phase": "compiling"}\n')
    logs[2].read()
    assert learner_rows(status, learners, logs, cfg)[2]["state"] == "compiling"

    plain = io.StringIO()
    PlainView(plain).update(3.0, status, learners, logs, cfg, SyncerProcess(proc=None, log=tmp_path / "s.log"))
    line = plain.getvalue().rstrip("\n")
    assert "L0:compiling@- L1:joining@- L2:compiling@5" in line
    assert line.endswith("| " + fit_words(REASON, DECISION_CHARS_MAX)) and line.endswith(" ...")
