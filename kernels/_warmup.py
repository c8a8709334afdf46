"""Compile (or load from numba's on-disk cache) every kernel before it is needed.

Nothing compiles at import. The syncer daemon calls warmup() at start so the first merge does not
pay seconds of compilation inside a grace window. Each kernel runs once below and once at or above
the parallel threshold, through its public wrapper, so exactly the argument types and both drivers
used in production are compiled.
"""

from __future__ import annotations

import numpy as np

from ddiloco.kernels import _bf16, _dense, _lowbit, _nesterov, _segments
from ddiloco.kernels._checks import BLOCK_DEFAULT
from ddiloco.kernels._parallelism import warmup_sizes

_CODECS = (
    (_lowbit.quantize_int4, _lowbit.dequantize_int4, _lowbit.accumulate_int4),
    (_lowbit.quantize_int2, _lowbit.dequantize_int2, _lowbit.accumulate_int2),
    (_lowbit.quantize_int1, _lowbit.dequantize_int1, _lowbit.accumulate_int1),
)


def _run_all(n: int) -> None:
    # Fixed, simple values: warm-up must not depend on randomness and must never raise.
    x = np.linspace(-1.0, 1.0, n, dtype=np.float32)
    acc = np.zeros(n, dtype=np.float32)
    for quantize, dequantize, accumulate in _CODECS:
        codes, scales = quantize(x, BLOCK_DEFAULT)
        dequantize(codes, scales, BLOCK_DEFAULT)
        accumulate(acc, 0.5, codes, scales, BLOCK_DEFAULT)
    _bf16.from_bf16(_bf16.to_bf16(x))
    _dense.accumulate(acc, 0.5, x)
    _dense.all_finite(x)
    offsets = np.array([0, n // 3, n // 3, n - BLOCK_DEFAULT // 2], dtype=np.int64)
    codes, scales = _lowbit.quantize_int4(x, BLOCK_DEFAULT)
    norms = np.sqrt(_segments.segment_sumsq(x, offsets))
    _segments.segment_sumsq_int4(codes, scales, offsets, BLOCK_DEFAULT)
    _segments.rda_accumulate(acc, 0.5, x, offsets, norms)
    _segments.rda_accumulate_int4(acc, 0.5, codes, scales, offsets, norms, BLOCK_DEFAULT)
    buf = np.zeros(n, dtype=np.float32)
    _nesterov.nesterov_step(acc, buf, x, 0.7, 0.9)
    # a round's fused kernels, with two contributions
    weights = np.array([0.25, 0.75])
    both = np.stack([norms, norms])
    _lowbit.round_mean_int4(acc, weights, [codes, codes], [scales, scales], BLOCK_DEFAULT)
    _lowbit.round_mean_step_int4(acc, buf, weights, [codes, codes], [scales, scales], 0.7, 0.9, BLOCK_DEFAULT)
    _dense.round_mean(acc, weights, [x, x])
    _dense.round_mean_step(acc, buf, weights, [x, x], 0.7, 0.9)
    _segments.rda_accumulate_round(acc, weights, [x, x], offsets, both)
    _segments.rda_accumulate_round_int4(acc, weights, [codes, codes], [scales, scales], offsets, both, BLOCK_DEFAULT)
    _segments.rda_accumulate_round_sumsq(acc, weights, [x, x], offsets, both)
    _segments.rda_accumulate_round_int4_sumsq(
        acc, weights, [codes, codes], [scales, scales], offsets, both, BLOCK_DEFAULT
    )
    _segments.nesterov_step_segments(acc, buf, x, offsets, np.ones(offsets.size - 1, np.float32), 0.7, 0.9)
    # the learner's one-pass encode and apply
    _, _, residual = _lowbit.quantize_delta_int4(x, acc, buf, BLOCK_DEFAULT)
    _lowbit.quantize_delta_int4(x, acc, None, BLOCK_DEFAULT)
    _lowbit.apply_delta_int4(acc, residual, codes, scales, BLOCK_DEFAULT)
    # the broadcast's publish and a learner's apply of it
    _lowbit.publish_delta_int4(acc, x, BLOCK_DEFAULT)
    _lowbit.add_delta_int4(acc, codes, scales, BLOCK_DEFAULT)
    _lowbit.add_delta_apart_int4(acc, x, codes, scales, BLOCK_DEFAULT)


def warmup() -> None:
    """Compile every kernel, serial and parallel drivers alike (a few MiB of scratch, freed after).
    On a single-thread pool (numba.get_num_threads() == 1) only the serial drivers run."""
    for n in warmup_sizes(BLOCK_DEFAULT):
        _run_all(n)
