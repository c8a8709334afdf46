"""Slicing by thread count, the per-call `parallel` choice, and the thread pool around child processes."""

import multiprocessing
import os
import time

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco import kernels
from ddiloco.kernels import _parallelism
from ddiloco.kernels._parallelism import REDUCTION_SLICES_MAX, SLICE_ELEMENTS_MIN, slice_bounds, thread_bounds


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 10**7), st.sampled_from([2, 8, 128, 1 << 14]), st.integers(1, 100))
def test_slice_bounds_cover_the_vector_in_balanced_aligned_slices(elements, unit, slices_max):
    b = slice_bounds(elements, unit, slices_max)
    units = -(-elements // unit)
    assert b[0] == 0 and b[-1] == elements
    assert b.size - 1 == min(slices_max, units)
    assert (np.diff(b) > 0).all()
    assert (b[:-1] % unit == 0).all()
    per_slice = np.diff(np.append(b[:-1], units * unit)) // unit
    assert per_slice.max() - per_slice.min() <= 1
    assert not b.flags.writeable


def test_slice_bounds_of_nothing_and_bad_requests():
    assert slice_bounds(0, 128).tolist() == [0, 0]
    with pytest.raises(ValueError):
        slice_bounds(10, 0)
    assert REDUCTION_SLICES_MAX == 64


def _compiled_versions():
    import numba

    from ddiloco.kernels import _bf16, _dense, _lowbit, _nesterov, _segments

    return {
        f"{m.__name__}.{k}": len(v.signatures)
        for m in (_bf16, _dense, _lowbit, _nesterov, _segments)
        for k, v in vars(m).items()
        if isinstance(v, numba.core.registry.CPUDispatcher)
    }


@pytest.mark.parametrize("frozen", [False, True])
def test_after_warmup_no_input_compiles_another_version(frozen):
    # Payloads are read-only views into received bytes; numba types a read-only array apart, so a
    # kernel first called with one would compile (holding the GIL for seconds) in the middle of a merge.
    kernels.warmup()
    before = _compiled_versions()

    def as_received(a):
        if frozen:
            a = np.frombuffer(a.tobytes(), dtype=a.dtype)
        return a

    for n in (512, 1 << 17):
        x = as_received(np.linspace(-1.0, 1.0, n, dtype=np.float32))
        acc = np.zeros(n, dtype=np.float32)
        offsets = as_received(np.array([0, n // 2, n], dtype=np.int64))
        for quantize, dequantize, accumulate in (
            (kernels.quantize_int4, kernels.dequantize_int4, kernels.accumulate_int4),
            (kernels.quantize_int2, kernels.dequantize_int2, kernels.accumulate_int2),
            (kernels.quantize_int1, kernels.dequantize_int1, kernels.accumulate_int1),
        ):
            codes, scales = (as_received(a) for a in quantize(x))
            dequantize(codes, scales)
            accumulate(acc, 0.5, codes, scales)
        codes, scales = (as_received(a) for a in kernels.quantize_int4(x))
        norms = as_received(np.sqrt(kernels.segment_sumsq(x, offsets)))
        kernels.segment_sumsq_int4(codes, scales, offsets)
        kernels.rda_accumulate(acc, 0.5, x, offsets, norms)
        kernels.rda_accumulate_int4(acc, 0.5, codes, scales, offsets, norms)
        kernels.from_bf16(as_received(kernels.to_bf16(x)))
        kernels.accumulate(acc, 0.5, x)
        kernels.all_finite(x)
        buf = np.zeros(n, dtype=np.float32)
        kernels.nesterov_step(acc, buf, x, 0.7, 0.9)
        weights = as_received(np.array([0.5, 0.5]))
        both = as_received(np.stack([norms, norms])).reshape(2, -1)
        factors = as_received(np.ones(2, dtype=np.float32))
        for parallel in (True, False):
            kernels.round_mean_int4(acc, weights, [codes, codes], [scales, scales], parallel=parallel)
            kernels.round_mean_step_int4(
                acc, buf, weights, [codes, codes], [scales, scales], 0.7, 0.9, parallel=parallel
            )
            kernels.round_mean(acc, weights, [x, x], parallel=parallel)
            kernels.round_mean_step(acc, buf, weights, [x, x], 0.7, 0.9, parallel=parallel)
            kernels.rda_accumulate_round(acc, weights, [x, x], offsets, both, parallel=parallel)
            kernels.rda_accumulate_round_int4(
                acc, weights, [codes, codes], [scales, scales], offsets, both, parallel=parallel
            )
            kernels.rda_accumulate_round_sumsq(acc, weights, [x, x], offsets, both, parallel=parallel)
            kernels.rda_accumulate_round_int4_sumsq(
                acc, weights, [codes, codes], [scales, scales], offsets, both, parallel=parallel
            )
            kernels.nesterov_step_segments(acc, buf, x, offsets, factors, 0.7, 0.9, parallel=parallel)
            _, _, residual = kernels.quantize_delta_int4(x, acc, as_received(buf), parallel=parallel)
            kernels.quantize_delta_int4(x, acc, parallel=parallel)
            kernels.apply_delta_int4(acc, residual, codes, scales, parallel=parallel)
    assert _compiled_versions() == before


def test_spawned_child_computes_the_same_bits():
    x = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    offsets = np.array([0, 1000, 600000, 1 << 20], dtype=np.int64)
    here = kernels.segment_sumsq(x, offsets)  # the parent's thread pool is running now
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        there = pool.apply(kernels.segment_sumsq, (x, offsets))
    np.testing.assert_array_equal(there, here)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() exists only on POSIX")
def test_forked_child_falls_back_to_serial_loops():
    n = 1 << 20
    x = np.ones(n, dtype=np.float32)
    acc = np.zeros(n, dtype=np.float32)
    kernels.accumulate(acc, 1.0, x)  # start the OpenMP pool in this process
    assert not _parallelism._forked_child
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: without the fallback OpenMP terminates it right here
        try:
            kernels.accumulate(acc, 2.0, x)
            os.write(write_end, b"ok" if (acc == 3.0).all() and _parallelism._forked_child else b"bad")
        finally:
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("forked child hung")
        time.sleep(0.05)
    message = os.read(read_end, 16)
    os.close(read_end)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
    assert message == b"ok"
    assert (acc == 1.0).all()  # the child's memory was its own


def test_parallel_false_keeps_the_calling_thread_and_the_same_bits():
    n = 4 * kernels.PARALLEL_ELEMENTS_MIN  # well above the size where the pool is used
    x = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    offsets = np.array([0, 1000, n // 2, n], dtype=np.int64)
    if numba.get_num_threads() > 1:
        assert thread_bounds(n, 128) is not None
    assert thread_bounds(n, 128, parallel=False) is None
    assert not _parallelism.use_parallel(n, parallel=False)
    pooled = (kernels.quantize_int4(x), kernels.segment_sumsq(x, offsets))
    serial = (kernels.quantize_int4(x, parallel=False), kernels.segment_sumsq(x, offsets, parallel=False))
    np.testing.assert_array_equal(serial[0][0], pooled[0][0])
    np.testing.assert_array_equal(serial[0][1], pooled[0][1])
    np.testing.assert_array_equal(serial[1], pooled[1])
    acc = np.zeros(n, dtype=np.float32)
    kernels.accumulate(acc, 0.5, x)
    kernels.accumulate(acc, -0.5, x, parallel=False)
    assert (acc == 0).all()
    # one caller's choice is its own: nothing process-wide was switched
    assert _parallelism.use_parallel(n) == (numba.get_num_threads() > 1)


@pytest.mark.parametrize("threads", [1, 2, 16, 96])
def test_elementwise_cut_is_one_aligned_slice_per_thread(threads, monkeypatch):
    # the cut follows the thread count numba has, on 2 cores and on a large host alike
    monkeypatch.setattr(_parallelism.numba, "get_num_threads", lambda: threads)
    for n, unit in ((1 << 16, 128), (1031 * 128, 128), (64 << 20, 128), (64 << 20, 1 << 14), (3 << 16, 1 << 14)):
        b = thread_bounds(n, unit)
        if threads == 1:
            assert b is None
            continue
        want = min(threads, n // max(unit, SLICE_ELEMENTS_MIN))
        assert b.size - 1 == want
        assert b[0] == 0 and b[-1] == n and (b[:-1] % unit == 0).all() and (np.diff(b) > 0).all()
        assert np.diff(b).min() >= SLICE_ELEMENTS_MIN // unit * unit


def test_results_do_not_depend_on_the_thread_count():
    # a replay on another host reproduces a merge exactly: sums use a cut of the length only, the
    # elementwise kernels compute each value alone
    n = (1 << 20) + 384
    rng = np.random.default_rng(5)
    x = rng.standard_normal(n).astype(np.float32)
    offsets = np.array([0, 1000, 300000, n - 100], dtype=np.int64)
    codes, scales = kernels.quantize_int4(x)
    norms = np.sqrt(kernels.segment_sumsq(x, offsets))

    def run():
        acc = np.zeros(n, dtype=np.float32)
        kernels.rda_accumulate_int4(acc, 0.3, codes, scales, offsets, norms)
        theta, buf = x.copy(), np.zeros(n, dtype=np.float32)
        kernels.round_mean_step_int4(theta, buf, np.array([0.25, 0.75]), [codes, codes], [scales, scales], 0.7, 0.9)
        return [
            kernels.segment_sumsq(x, offsets),
            kernels.segment_sumsq_int4(codes, scales, offsets),
            acc,
            theta,
            buf,
            *kernels.quantize_int4(x),
        ]

    before = numba.get_num_threads()
    results = []
    try:
        for t in sorted({1, 2, before}):
            if t <= numba.config.NUMBA_NUM_THREADS:
                numba.set_num_threads(t)
                results.append(run())
    finally:
        numba.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)
