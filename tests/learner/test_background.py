"""The hook's background thread (learner.background): the same bytes as the training thread would
compute, and the training thread's own computation wherever the thread's inputs were not the hook's."""

import time

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
        job = bg.encode(background.PushWork(_gather(theta), state, _flight(frag), feedback, "int4", True, BLOCK))
        got = job.result()
    finally:
        bg.close()
    payload, left = pushes.encode_increment(state, _flight(frag), theta, feedback, "int4", True, BLOCK, False)
    assert got.payload.header() + got.payload.body.tobytes() == payload and np.array_equal(got.theta, theta)
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
        prepared = bg.difference(made, anchor)
        assert np.array_equal(prepared.difference, expected - anchor) and prepared.placed is None  # not told where
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


def test_the_difference_is_placed_on_the_leaves_devices_as_the_hook_would_add_it():
    """Told where the fragment's leaves live, the thread puts the difference there too; added, it
    gives the bits of the hook's own add, and a placement that no longer fits the leaves is refused."""
    import jax
    import jax.numpy as jnp

    from ddiloco.core.layout import build_layout
    from ddiloco.learner.tree import TreeFragments, tensor_specs

    params = {"a": jnp.linspace(-1, 1, 512, dtype=jnp.float32), "b": jnp.ones((16, 32), jnp.bfloat16)}
    tree = TreeFragments(params, build_layout(tensor_specs(params), 1))
    n = tree.layout.fragments[0].padded_size
    rng = np.random.default_rng(2)
    held, anchor = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    update = session.UpdateInfo(0, 5, codec.parse(codec.encode(held, "fp32")))
    bg = background.Background()
    try:
        bg.holds(0, 4, np.zeros(n, np.float32), anchor, lambda d: tree.place(0, tree.placement(params, 0), d))
        bg.offer(update)
        made = bg.published(update, None)
        prepared = bg.difference(made, anchor)
    finally:
        bg.close()
    assert prepared.placed is not None and tree.fits(params, 0, prepared.placed)
    mine, theirs = tree.add(params, 0, made - anchor), tree.add_placed(params, 0, prepared.placed)
    for key in params:
        assert mine[key].dtype == theirs[key].dtype == params[key].dtype
        assert np.array_equal(np.asarray(jax.device_get(mine[key])), np.asarray(jax.device_get(theirs[key])))
    # the leaves changed type since: what was placed for the old ones does not fit
    changed = {**params, "b": params["b"].astype(jnp.float32)}
    assert not tree.fits(changed, 0, prepared.placed)


def test_a_push_sent_from_the_thread_moves_the_anchor_so_an_update_before_the_booking_is_ready():
    """A push the thread sends itself is the anchor of the progress kept over the next version (the
    hook says so when it books the push, `pushes.sent`). An update that arrives before that call is
    decoded against the push's host copy already, so the hook finds the difference ready; a push the
    transport refused moves nothing, and neither does one of a version the hook no longer holds."""
    rng = np.random.default_rng(3)
    base, theta = (rng.standard_normal(1024).astype(np.float32) for _ in range(2))
    frag = FragmentSync(version=3, base=base, published=base)
    state, feedback = pushes.Pushes(last={}), codec.feedback_init(base.size)
    delta = session.UpdateInfo(
        0, 4, codec.parse(codec.encode(rng.standard_normal(1024).astype(np.float32), "int4", BLOCK)), base_version=3
    )

    def run(accepted: bool, push_version: int):
        bg = background.Background()
        try:
            bg.holds(0, 3, base, base)  # the progress kept since the version held
            pushed = FragmentSync(version=push_version, base=base, published=base)
            work = background.PushWork(_gather(theta), state, _flight(pushed), feedback, "int4", True, BLOCK)
            sent = bg.encode(work, lambda payload: (None, accepted)).result()
            bg.offer(delta)
            made = bg.published(delta, base)
            return sent, made, bg.difference(made, sent.theta), bg.difference(made, base)
        finally:
            bg.close()

    sent, made, prepared, old_anchor = run(True, 3)
    expected = arrivals.apply_update(base, delta, False)
    assert np.array_equal(made, expected) and np.array_equal(sent.theta, theta)
    # the anchor the hook computes at the booking is the very array the thread decoded against
    booked = pushes.sent(state, _flight(frag), sent.theta)
    kept = arrivals.kept_progress(frag, pushes.last_from(booked, 0, 3), True, 0.0)
    assert kept.anchor is sent.theta
    assert prepared is not None and np.array_equal(prepared.difference, expected - theta) and old_anchor is None
    # refused by the transport, or a push of another version than the one held: the anchor stays
    for accepted, version in ((False, 3), (True, 2)):
        _, made, prepared, old_anchor = run(accepted, version)
        assert prepared is None and np.array_equal(old_anchor.difference, expected - base)


def test_finished_grows_once_a_job_has_its_result_and_never_before():
    """learner.sync's quiet calls compare `finished` with the count they read: a job that ended since
    (a push sent, a decode done) must show in it, and only once its result is there to take."""
    import threading

    rng = np.random.default_rng(2)
    base, theta = (rng.standard_normal(1024).astype(np.float32) for _ in range(2))
    release = threading.Event()

    def gather(q, leaves):
        assert release.wait(10)
        return theta.copy()

    bg = background.Background()
    try:
        assert bg.finished == 0
        work = background.PushWork(
            gather, pushes.Pushes(last={}), _flight(FragmentSync(version=3, base=base)), None, "int4", True, BLOCK
        )
        job = bg.encode(work)
        assert not job.done() and bg.finished == 0  # at its work: nothing to take yet
        release.set()
        job.result()
        deadline = time.monotonic() + 10
        while bg.finished < 1:  # the count follows the result (a done callback)
            assert time.monotonic() < deadline
            time.sleep(0.001)
        update = session.UpdateInfo(0, 5, codec.parse(codec.encode(base, "fp32")))
        bg.offer(update)
        assert np.array_equal(bg.published(update, None), base)
        while bg.finished < 2:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert bg.finished == 2 and not bg.decoding([update])
    finally:
        bg.close()
