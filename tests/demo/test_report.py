"""The demo's report says what the token ledger counts: tokens trained, and what became of them."""

from dataclasses import asdict

from ddiloco.core.ledger import Ledger
from ddiloco.demo.config import DemoConfig
from ddiloco.demo.report import DemoReport, ledger_lines, report_text, trained_tokens


def books(fragments: int) -> dict:
    """A real ledger: two learners each train 3 steps of 100 tokens, counted per fragment as the
    syncer counts them; each fragment's window then ends in one fate."""
    ledger = Ledger()
    for learner in (1, 2):
        for p in range(fragments):
            ledger.report(learner, p, 300, reset=False)
    ledger.fate(1, 0, 300, "merged")
    ledger.fate(2, 0, 300, "late")
    ledger.learner_gone(2)  # its other fragments' tokens were never pushed: lost
    ledger.check()
    return ledger.summary()


def test_the_ledger_is_explained_as_tokens_trained_and_shares_per_fragment():
    fragments = 4
    summary = books(fragments)
    status = {"ledger": summary, "fragments": [{}] * fragments}
    assert summary["reported"] == fragments * 600 and trained_tokens(status) == 600
    first, second = ledger_lines(summary, fragments)
    assert "each of the 600 tokens trained is counted once for each of the 4 fragments (2,400 in all)" in first
    shares = dict(part.rsplit(" ", 1) for part in second.split(": ", 1)[1].split(", "))
    assert list(shares) == ["merged", "late", "stale", "rejected", "lost", "open"]
    assert shares["merged"] == shares["late"] == "12.5%" and shares["lost"] == shares["open"] == "37.5%"
    assert sum(float(v.rstrip("%")) for v in shares.values()) == 100.0


def test_the_report_text_carries_the_explained_ledger_not_the_raw_dict():
    cfg = DemoConfig(fragments=4)
    summary = books(4)
    report = DemoReport(
        eval_loss=2.0,
        eval_bits_per_byte=2.9,
        baseline_eval_loss=None,
        baseline_bits_per_byte=None,
        choice_accuracy=None,
        baseline_choice_accuracy=None,
        uptime=1.0,
        longest_merge_gap_s=0.5,
        goodput=1.0,
        kills=0,
        recoveries=0,
        merges=3,
        ledger=summary,
        wall_s=10.0,
        config=asdict(cfg),
        tokens_trained=600,
        token_budget=1000,
        global_steps=3,
    )
    text = report_text(report)
    assert "\n".join(ledger_lines(summary, 4)) in text and str(summary) not in text
    assert ledger_lines({}, 4) == ["token ledger   nothing reported"]
