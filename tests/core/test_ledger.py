from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core.ledger import Ledger


def test_window_fates():
    led = Ledger()
    led.report(1, 0, 300, reset=False)
    led.fate(1, 0, 300, "merged")
    led.report(1, 0, 500, reset=False)  # 200 more trained after the push
    led.report(1, 0, 100, reset=True)  # received the merged fragment: those 200 were overwritten
    assert led.totals["merged"] == 300 and led.totals["lost"] == 200
    assert led.open == 100 and led.reported == 600
    led.check()


def test_second_push_of_same_window_counts_once():
    led = Ledger()
    led.report(2, 1, 400, reset=False)
    led.fate(2, 1, 400, "stale")
    led.fate(2, 1, 450, "merged")  # resent after the stale answer with a grown counter
    assert led.totals["stale"] == 400 and led.totals["merged"] == 50
    assert led.of_learner(2) == {"merged": 50, "late": 0, "stale": 400, "rejected": 0}
    assert led.of_learner(1) == {"merged": 0, "late": 0, "stale": 0, "rejected": 0}
    led.check()


def test_gone_learner_books_unpushed_as_lost():
    led = Ledger()
    led.report(3, 0, 70, reset=False)
    led.report(3, 1, 90, reset=False)
    led.fate(3, 1, 90, "late")
    led.learner_gone(3)
    assert led.totals["lost"] == 70 and led.totals["late"] == 90 and led.open == 0
    led.check()


def test_gone_learner_keeps_the_window_of_a_push_awaiting_its_round():
    led = Ledger()
    led.report(3, 0, 70, reset=False)
    led.report(3, 1, 90, reset=False)
    led.fate(3, 1, 60, "merged")  # an earlier push of the same window, already decided
    led.learner_gone(3, awaiting=frozenset({1}))
    assert led.totals["lost"] == 70 and led.open == 30
    led.settle(3, 1, 80, "merged")  # the waiting push, decided after the learner left
    assert led.totals["merged"] == 80 and led.totals["lost"] == 80 and led.open == 0
    led.settle(3, 0, 70, "merged")  # not kept open: already booked as lost, booked nowhere else
    assert led.totals["merged"] == 80 and led.reported == 160
    led.check()


ops = st.lists(
    st.tuples(
        st.sampled_from(["report", "reset", "fate", "gone", "gone_awaiting", "settle"]),
        st.integers(1, 3),
        st.integers(0, 2),
        st.integers(0, 1000),
        st.sampled_from(["merged", "late", "stale", "rejected"]),
    ),
    max_size=60,
)


@settings(max_examples=80, deadline=None)
@given(ops)
def test_books_always_balance(sequence):
    led = Ledger()
    for op, learner, fragment, tokens, fate in sequence:
        if op in ("report", "reset"):
            led.report(learner, fragment, tokens, reset=op == "reset")
        elif op == "fate":
            led.fate(learner, fragment, tokens, fate)
        elif op == "settle":
            led.settle(learner, fragment, tokens, fate)
        else:
            led.learner_gone(learner, frozenset({fragment}) if op == "gone_awaiting" else frozenset())
        led.check()
        assert all(v >= 0 for v in led.totals.values()) and led.open >= 0
        # every pushed token is booked to exactly one learner too
        for fate in ("merged", "late", "stale", "rejected"):
            assert sum(led.of_learner(m)[fate] for m in (1, 2, 3)) == led.totals[fate], fate
