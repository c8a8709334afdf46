"""Slicing, and the thread pool's behaviour around child processes."""

import multiprocessing
import os
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco import kernels
from ddiloco.kernels import _parallelism
from ddiloco.kernels._parallelism import SLICES_MAX, slice_bounds


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
    assert SLICES_MAX == 64


def _compiled_versions():
    import numba

    from ddiloco.kernels import _bf16, _dense, _int1, _int2, _int4, _nesterov, _segments

    return {f"{m.__name__}.{k}": len(v.signatures) for m in (_bf16, _dense, _int1, _int2, _int4, _nesterov, _segments)
            for k, v in vars(m).items() if isinstance(v, numba.core.registry.CPUDispatcher)}


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
        for quantize, dequantize, accumulate in ((kernels.quantize_int4, kernels.dequantize_int4, kernels.accumulate_int4),
                                                 (kernels.quantize_int2, kernels.dequantize_int2, kernels.accumulate_int2),
                                                 (kernels.quantize_int1, kernels.dequantize_int1, kernels.accumulate_int1)):
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
        kernels.nesterov_step(acc, np.zeros(n, dtype=np.float32), x, 0.7, 0.9)
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


def test_serial_only_keeps_every_kernel_on_the_calling_thread_with_the_same_bits():
    n = 4 * kernels.PARALLEL_ELEMENTS_MIN  # well above the size where the pool is used
    x = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    offsets = np.array([0, 1000, n // 2, n], dtype=np.int64)
    acc = np.zeros(n, dtype=np.float32)
    pooled = (kernels.quantize_int4(x), kernels.segment_sumsq(x, offsets))
    kernels.accumulate(acc, 0.5, x)
    assert _parallelism.use_parallel(n)
    kernels.serial_only()
    try:
        assert not _parallelism.use_parallel(n)
        serial = (kernels.quantize_int4(x), kernels.segment_sumsq(x, offsets))
        kernels.accumulate(acc, -0.5, x)
    finally:
        kernels.serial_only(False)
    assert _parallelism.use_parallel(n)
    np.testing.assert_array_equal(serial[0][0], pooled[0][0])
    np.testing.assert_array_equal(serial[0][1], pooled[0][1])
    np.testing.assert_array_equal(serial[1], pooled[1])
    assert (acc == 0).all()
