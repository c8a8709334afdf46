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


def test_tokens_carried_over_a_merge_move_to_the_next_window_once():
    led = Ledger()
    led.report(1, 0, 300, reset=False)
    led.hold(1, 0, 300)  # pushed at 300
    led.report(1, 0, 500, reset=False)  # 200 more trained after the push
    led.decide(1, 0, "merged")
    # The merged version arrived; the learner kept the 200 (and trained 50 more): they are its new
    # window's first 250 tokens, not lost, and reported once.
    led.report(1, 0, 250, reset=True, carried=200)
    assert led.totals["merged"] == 300 and led.totals["lost"] == 0
    assert led.open == 250 and led.reported == 550
    led.fate(1, 0, 250, "merged")
    assert led.totals["merged"] == 550 and led.open == 0
    led.check()


def test_a_carried_claim_beyond_the_window_moves_only_what_it_holds():
    led = Ledger()
    led.report(1, 0, 100, reset=False)
    led.fate(1, 0, 60, "merged")
    led.report(1, 0, 900, reset=True, carried=900)  # more than the 40 unfated: 40 move
    assert led.totals["lost"] == 0 and led.reported == 60 + 900
    led.check()


def test_second_push_of_same_window_counts_once():
    led = Ledger()
    led.report(2, 1, 400, reset=False)
    led.fate(2, 1, 400, "stale")
    led.fate(2, 1, 450, "merged")  # resent after the stale answer with a grown counter
    assert led.totals["stale"] == 400 and led.totals["merged"] == 50
    assert led.of_learner(2) == {"merged": 50, "merged_late": 0, "late": 0, "stale": 400, "rejected": 0}
    assert led.of_learner(1) == {"merged": 0, "merged_late": 0, "late": 0, "stale": 0, "rejected": 0}
    led.check()


def test_gone_learner_books_unpushed_as_lost():
    led = Ledger()
    led.report(3, 0, 70, reset=False)
    led.report(3, 1, 90, reset=False)
    led.fate(3, 1, 90, "late")
    led.learner_gone(3)
    assert led.totals["lost"] == 70 and led.totals["late"] == 90 and led.open == 0
    led.check()


def test_held_tokens_of_a_waiting_push_outlive_its_window_and_learner():
    led = Ledger()
    led.report(3, 0, 70, reset=False)
    led.report(3, 1, 90, reset=False)
    led.fate(3, 1, 60, "merged")  # an earlier push of the same window, already decided
    led.hold(3, 1, 80)  # a push admitted, waiting for its round: 20 fresh tokens held
    led.report(3, 1, 10, reset=True)  # the learner took a newer version: the window closes
    assert led.totals["lost"] == 10 and led.held == {(3, 1): 20}
    led.learner_gone(3)
    assert led.totals["lost"] == 10 + 70 + 10 and led.open == 20
    led.decide(3, 1, "merged_late")  # the waiting push, merged after the learner left
    assert led.totals["merged_late"] == 20 and led.open == 0 and led.of_learner(3)["merged_late"] == 20
    led.decide(3, 1, "merged")  # nothing held any more: booked nowhere
    assert led.totals["merged"] == 60
    led.check()


def test_a_replaced_push_adds_its_fresh_tokens_and_a_lost_one_books_them_lost():
    led = Ledger()
    led.report(1, 0, 300, reset=False)
    led.hold(1, 0, 100)
    led.hold(1, 0, 300)  # a newer push of the same window replaces it: it holds all 300
    assert led.held[(1, 0)] == 300
    led.decide(1, 0, "lost")
    assert led.totals["lost"] == 300 and led.of_learner(1) == dict.fromkeys(led.of_learner(1), 0)
    led.check()


ops = st.lists(
    st.tuples(
        st.sampled_from(["report", "reset", "fate", "gone", "hold", "decide"]),
        st.integers(1, 3),
        st.integers(0, 2),
        st.integers(0, 1000),
        st.sampled_from(["merged", "merged_late", "late", "stale", "rejected", "lost"]),
    ),
    max_size=60,
)


@settings(max_examples=80, deadline=None)
@given(ops)
def test_books_always_balance(sequence):
    led = Ledger()
    for op, learner, fragment, tokens, fate in sequence:
        if op in ("report", "reset"):
            led.report(learner, fragment, tokens, reset=op == "reset", carried=tokens // 2)
        elif op == "fate":
            led.fate(learner, fragment, tokens, fate)
        elif op == "hold":
            led.hold(learner, fragment, tokens)
        elif op == "decide":
            led.decide(learner, fragment, fate)
        else:
            led.learner_gone(learner)
        led.check()
        assert all(v >= 0 for v in led.totals.values()) and led.open >= 0
        # every pushed token is booked to exactly one learner too
        for fate in ("merged", "merged_late", "late", "stale", "rejected"):
            assert sum(led.of_learner(m)[fate] for m in (1, 2, 3)) == led.totals[fate], fate
