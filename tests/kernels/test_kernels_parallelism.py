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


def test_warmup_runs():
    kernels.warmup()


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
