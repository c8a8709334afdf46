"""numba CPU kernels behind validating wrappers, each with a numpy reference.

Every kernel takes 1-D C-contiguous arrays of an exact dtype and raises KernelInputError (a
ValueError) naming the argument when one is wrong; the checks run before any loop, so on error
nothing has been modified. Block codecs take vectors whose length is a multiple of `block`.
All loops release the GIL (the syncer runs them in an executor) and are compiled lazily, or by
warmup(). `ddiloco.kernels.reference` holds a plain-numpy version of each with the same signature.
"""

from ddiloco.kernels._bf16 import from_bf16, to_bf16
from ddiloco.kernels._checks import BLOCK_DEFAULT
from ddiloco.kernels._dense import accumulate, all_finite, count_nonfinite
from ddiloco.kernels._errors import KernelInputError
from ddiloco.kernels._int1 import accumulate_int1, dequantize_int1, quantize_int1
from ddiloco.kernels._int2 import accumulate_int2, dequantize_int2, quantize_int2
from ddiloco.kernels._int4 import accumulate_int4, dequantize_int4, quantize_int4
from ddiloco.kernels._nesterov import nesterov_step
from ddiloco.kernels._parallelism import PARALLEL_ELEMENTS_MIN, serial_only, warmup_sizes
from ddiloco.kernels._segments import rda_accumulate, rda_accumulate_int4, segment_sumsq, segment_sumsq_int4
from ddiloco.kernels._warmup import warmup

__all__ = [
    "BLOCK_DEFAULT",
    "PARALLEL_ELEMENTS_MIN",
    "KernelInputError",
    "accumulate",
    "accumulate_int1",
    "accumulate_int2",
    "accumulate_int4",
    "all_finite",
    "count_nonfinite",
    "dequantize_int1",
    "dequantize_int2",
    "dequantize_int4",
    "from_bf16",
    "nesterov_step",
    "quantize_int1",
    "quantize_int2",
    "quantize_int4",
    "rda_accumulate",
    "rda_accumulate_int4",
    "segment_sumsq",
    "segment_sumsq_int4",
    "serial_only",
    "to_bf16",
    "warmup",
    "warmup_sizes",
]
