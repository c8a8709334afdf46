"""The validating wrappers of the blockwise codecs (int4, int2, int1), written once.

A codec differs from the others only in how many codes share a byte and in its numba loops; all
checks, allocation and the choice of driver live here. Each codec keeps its own parallel drivers
next to its serial loops rather than sharing one here: numba's on-disk cache can only key a
function on the types of its arguments and is invalidated only by edits to the function's own
file, so a shared driver taking the loop as an argument (or closing over it) would recompile in
every process, and one importing the loops from another file could run stale code after an edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ddiloco.kernels import _checks
from ddiloco.kernels._errors import KernelInputError
from ddiloco.kernels._parallelism import slice_bounds, use_parallel


@dataclass(frozen=True)
class BlockCodec:
    """One codec's loops, `per_byte` codes to a uint8 byte (so blocks are multiples of it).

    Each operation is a pair (serial, parallel): a serial loop over whole blocks, and a driver taking
    the same arguments plus the slice bounds (multiples of the block) it runs that loop over.
    """

    per_byte: int
    quantize_loops: tuple[Callable, Callable]
    dequantize_loops: tuple[Callable, Callable]
    accumulate_loops: tuple[Callable, Callable]

    def quantize(self, x: np.ndarray, block: object) -> tuple[np.ndarray, np.ndarray]:
        block = _checks.block_size(block, self.per_byte)
        x = _checks.vector("x", x, np.float32)
        blocks = _checks.blocked_length("x", x.size, block)
        codes = np.empty(x.size // self.per_byte, dtype=np.uint8)
        scales = np.empty(blocks, dtype=np.float32)
        serial, parallel = self.quantize_loops
        # The loops read the absmax (and Inf/NaN) off the bit patterns, hence the uint32 view.
        if use_parallel(x.size):
            bad = parallel(x, x.view(np.uint32), codes, scales, block, slice_bounds(x.size, block))
        else:
            bad = serial(x, x.view(np.uint32), codes, scales, block)
        if bad:
            # The outputs were fresh and are dropped here, so the caller sees nothing modified.
            raise KernelInputError(f"x has NaN or Inf values in {bad} of its {blocks} blocks")
        return codes, scales

    def dequantize(self, codes: np.ndarray, scales: np.ndarray, block: object, out: np.ndarray | None) -> np.ndarray:
        block, n, codes, scales = _checks.coded(codes, scales, block, self.per_byte)
        out = _checks.out_vector(out, np.float32, n)
        _checks.disjoint(out=out, codes=codes, scales=scales)
        serial, parallel = self.dequantize_loops
        if use_parallel(n):
            parallel(codes, scales, out, block, slice_bounds(n, block))
        else:
            serial(codes, scales, out, block)
        return out

    def accumulate(self, acc: np.ndarray, weight: object, codes: np.ndarray, scales: np.ndarray, block: object) -> None:
        _checks.vector("acc", acc, np.float32, writeable=True)
        weight = _checks.finite_scalar("weight", weight)
        block, n, codes, scales = _checks.coded(codes, scales, block, self.per_byte, acc.size)
        _checks.disjoint(acc=acc, codes=codes, scales=scales)
        serial, parallel = self.accumulate_loops
        if use_parallel(n):
            parallel(acc, weight, codes, scales, block, slice_bounds(n, block))
        else:
            serial(acc, weight, codes, scales, block)
