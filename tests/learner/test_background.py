"""The hook's background thread (learner.background): the same bytes as the training thread would
compute, and the training thread's own computation wherever the thread's inputs were not the hook's."""

import numpy as np

from ddiloco.core import codec
from ddiloco.learner import arrivals, background, pushes
from ddiloco.learner.fragment import FragmentSync
from ddiloco.net import session

BLOCK = 64


def _gather(values):
    return lambda q, leaves: values.copy()


def _flight(frag):
    return pushes.InFlight(0, 7, frag, [])


def test_a_push_encoded_in_the_background_is_the_bytes_encoded_at_the_send():
    rng = np.random.default_rng(0)
    base, theta = (rng.standard_normal(1024).astype(np.float32) for _ in range(2))
    frag = FragmentSync(version=3, base=base)
    state = pushes.Pushes(last={})
    feedback = codec.feedback_init(base.size)
    bg = background.Background()
    try:
        job = bg.encode(_gather(theta), state, _flight(frag), feedback, "int4", True, BLOCK)
        got = job.result()
    finally:
        bg.close()
    payload, left = pushes.encode_increment(state, _flight(frag), theta, feedback, "int4", True, BLOCK, False)
    assert got.payload == payload and np.array_equal(got.theta, theta)
    assert np.array_equal(got.feedback.residual, left.residual)
    # inputs the hook no longer holds (a push of the fragment went out since): not valid, done again
    assert job.still_valid(None, feedback) and not job.still_valid(None, codec.feedback_init(base.size))
    later = pushes.sent(state, _flight(frag), theta)
    assert not job.still_valid(pushes.last_from(later, 0, 3), feedback)


def test_an_update_decoded_in_the_background_is_the_copy_the_hook_would_make():
    rng = np.random.default_rng(1)
    held, anchor = (rng.standard_normal(1024).astype(np.float32) for _ in range(2))
    whole = session.UpdateInfo(0, 5, codec.parse(codec.encode(held, "fp32")))
    delta = session.UpdateInfo(
        0, 6, codec.parse(codec.encode(rng.standard_normal(1024).astype(np.float32), "int4", BLOCK)), base_version=5
    )
    bg = background.Background()
    try:
        bg.holds(0, 4, np.zeros(1024, np.float32), anchor)
        bg.offer(whole)
        assert np.array_equal(bg.published(whole, None), held)  # waits for the job under way
        bg.offer(delta)
        made = bg.published(delta, bg.published(whole, None))
        expected = arrivals.apply_update(held, delta, False)
        assert np.array_equal(made, expected)
        assert np.array_equal(bg.difference(made, anchor), expected - anchor)
        # onto another array than the one it was decoded onto, or after its fragment was forgotten:
        # nothing, and the hook decodes it itself
        assert bg.published(delta, held.copy()) is None and bg.difference(made, anchor.copy()) is None
        bg.forget({0})
        assert bg.published(delta, made) is None
    finally:
        bg.close()
    # reach with and without what the thread made: the same bytes
    frag = FragmentSync(version=5, base=held, published=held)
    assert np.array_equal(arrivals.reach(frag, [delta], False).published, expected)
