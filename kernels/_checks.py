"""Validation shared by the kernel wrappers: every check runs before a loop touches memory.

Each function raises KernelInputError naming the argument; none of them copies or converts, because a
silent conversion would hide a caller's bug and cost a pass over the data. An input the kernels only
read comes back as a read-only view: numba compiles a read-only array as a type of its own, and
payloads are read-only views into the bytes received, so passing every input read-only means one
compiled version per kernel, the one warmup() compiles, whoever calls.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from ddiloco.kernels._errors import KernelInputError

FLOAT32_MAX = float(np.finfo(np.float32).max)
# Values per scale in the block codecs; core pads fragments with zeros to a multiple of it.
BLOCK_DEFAULT = 128


def vector(name: str, a: object, dtype: np.dtype | type, *, writeable: bool = False) -> np.ndarray:
    """`a`, provided it is a 1-D C-contiguous ndarray of exactly `dtype`: itself when it is written
    in place (`writeable`), else a read-only view of it (see the module docstring)."""
    if not isinstance(a, np.ndarray):
        raise KernelInputError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.ndim != 1:
        raise KernelInputError(f"{name} must be 1-D, got shape {a.shape}")
    if a.dtype != np.dtype(dtype):
        raise KernelInputError(f"{name} must have dtype {np.dtype(dtype)}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise KernelInputError(f"{name} must be C-contiguous (got a strided view)")
    if writeable and not a.flags.writeable:
        raise KernelInputError(f"{name} is written in place and must be writeable")
    if writeable:
        return a
    view = a.view()
    view.flags.writeable = False
    return view


def matrix(name: str, a: object, dtype: type, shape: tuple[int, int]) -> np.ndarray:
    """A C-contiguous 2-D array of exactly `dtype` and `shape`, as a read-only view."""
    if not isinstance(a, np.ndarray):
        raise KernelInputError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.shape != shape:
        raise KernelInputError(f"{name} must have shape {shape}, got {a.shape}")
    if a.dtype != np.dtype(dtype):
        raise KernelInputError(f"{name} must have dtype {np.dtype(dtype)}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise KernelInputError(f"{name} must be C-contiguous (got a strided view)")
    view = a.view()
    view.flags.writeable = False
    return view


def length(name: str, a: np.ndarray, expected: int) -> None:
    if a.size != expected:
        raise KernelInputError(f"{name} must have {expected} elements, got {a.size}")


def block_size(block: object, multiple: int) -> int:
    """The block as an int: positive, even and a multiple of `multiple` (codes per byte)."""
    if isinstance(block, bool) or not isinstance(block, numbers.Integral):
        raise KernelInputError(f"block must be an integer, got {type(block).__name__}")
    block = int(block)
    if block <= 0 or block % 2 or block % multiple:
        raise KernelInputError(f"block must be a positive even multiple of {multiple}, got {block}")
    return block


def blocked_length(name: str, n: int, block: int) -> int:
    """Number of blocks in a vector of `n` elements; core pads fragments so this divides exactly."""
    if n % block:
        raise KernelInputError(f"{name} has {n} elements, not a multiple of block={block}")
    return n // block


def finite_scalar(name: str, value: object) -> float:
    """A real number that is finite and fits float32 (the kernels scale float32 data by it)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise KernelInputError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise KernelInputError(f"{name} must be finite, got {value}")
    if abs(value) > FLOAT32_MAX:
        raise KernelInputError(f"{name}={value} is outside the float32 range")
    return value


def non_negative_finite(name: str, v: np.ndarray, value_max: float) -> None:
    """Every value in [0, value_max]. min/max propagate NaN, so two reductions cover NaN, Inf and sign
    without allocating a boolean temporary."""
    if v.size and not (v.min() >= 0.0 and v.max() <= value_max):
        raise KernelInputError(f"{name} must be finite and non-negative")


def coded(
    codes: object, scales: object, block: object, per_byte: int, elements: int | None = None
) -> tuple[int, int, np.ndarray, np.ndarray]:
    """Validate a block-coded vector: `per_byte` codes per uint8 byte, one float32 scale per block.

    `elements` is the length the caller needs (that of `acc`), or None to take it from the scales.
    Scales must be finite and non-negative: the quantizers never produce anything else, so a
    violation means a corrupt payload. Returns (block, elements, codes, scales), the arrays read-only.
    """
    block = block_size(block, per_byte)
    codes = vector("codes", codes, np.uint8)
    scales = vector("scales", scales, np.float32)
    if elements is None:
        elements = scales.size * block
    else:
        length("scales", scales, blocked_length("acc", elements, block))
    length("codes", codes, elements // per_byte)
    non_negative_finite("scales", scales, FLOAT32_MAX)
    return block, elements, codes, scales


def offsets(name: str, o: object, n: int) -> tuple[int, np.ndarray]:
    """Segment boundaries: start at 0, never decrease, end at most at `n` (padding may follow).
    Returns the number of segments and the boundaries, read-only."""
    o = vector(name, o, np.int64)
    if o.size < 1:
        raise KernelInputError(f"{name} must hold at least one boundary (0)")
    if o[0] != 0:
        raise KernelInputError(f"{name} must start at 0, got {int(o[0])}")
    if o.size > 1 and (np.diff(o) < 0).any():
        raise KernelInputError(f"{name} must be non-decreasing")
    if o[-1] > n:
        raise KernelInputError(f"{name} ends at {int(o[-1])}, past the {n} elements of the data")
    return o.size - 1, o


def sequence(name: str, items: object, count: int) -> list:
    """A list or tuple of `count` items (one per contribution), as a new list."""
    if not isinstance(items, (list, tuple)):
        raise KernelInputError(f"{name} must be a list or tuple of arrays, got {type(items).__name__}")
    if len(items) != count:
        raise KernelInputError(f"{name} must hold {count} arrays (one per weight), got {len(items)}")
    return list(items)


def weights(w: object) -> np.ndarray:
    """A round's contribution weights: float64[m], m >= 1, finite and non-negative (read-only view)."""
    w = vector("weights", w, np.float64)
    if w.size < 1:
        raise KernelInputError("weights must hold at least one contribution")
    non_negative_finite("weights", w, FLOAT32_MAX)
    return w


def out_vector(out: object, dtype: np.dtype | type, elements: int) -> np.ndarray:
    """A caller's output buffer, or a fresh one when `out` is None."""
    if out is None:
        return np.empty(elements, dtype=dtype)
    vector("out", out, dtype, writeable=True)
    length("out", out, elements)
    return out


def disjoint(**arrays: np.ndarray) -> None:
    """In-place outputs must not overlap any other argument: the slices run concurrently, so an
    overlapping view would race (and even an exact alias changes the meaning of the update)."""
    items = list(arrays.items())
    for i, (name_a, a) in enumerate(items):
        for name_b, b in items[i + 1 :]:
            if np.may_share_memory(a, b):
                raise KernelInputError(f"{name_a} and {name_b} must not share memory")


def written_apart(written: dict[str, np.ndarray], read: dict[str, np.ndarray]) -> None:
    """`disjoint` for kernels with many inputs: every array written must not overlap any other
    argument; the inputs, only read, may share memory with each other (one payload sent twice)."""
    items = list(written.items())
    for i, (name_a, a) in enumerate(items):
        for name_b, b in items[i + 1 :] + list(read.items()):
            if np.may_share_memory(a, b):
                raise KernelInputError(f"{name_a} and {name_b} must not share memory")
