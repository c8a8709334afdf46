"""numba CPU kernels behind validating wrappers, each with a numpy reference.

Every kernel takes 1-D C-contiguous arrays of an exact dtype and raises KernelInputError (a
ValueError) naming the argument when one is wrong; the checks run before any loop, so on error
nothing has been modified. Block codecs take vectors whose length is a multiple of `block`.
All loops release the GIL (the syncer runs them in an executor) and are compiled lazily, or by
warmup(). Every wrapper takes `parallel=True`: False keeps the call on the calling thread (a learner's
codec work beside its training step); results are the same bits either way (see _parallelism).
A round's merge has fused kernels (round_mean*, rda_accumulate_round*, nesterov_step_segments) that
read every contribution once, and the learner has one-pass encode and apply (quantize_delta_int4,
apply_delta_int4). `ddiloco.kernels.reference` holds a plain-numpy version of each with the same signature.
"""

from ddiloco.kernels._bf16 import from_bf16, to_bf16
from ddiloco.kernels._checks import BLOCK_DEFAULT
from ddiloco.kernels._dense import accumulate, all_finite, count_nonfinite, round_mean, round_mean_step
from ddiloco.kernels._errors import KernelInputError
from ddiloco.kernels._lowbit import (
    accumulate_int1,
    accumulate_int2,
    accumulate_int4,
    apply_delta_int4,
    dequantize_int1,
    dequantize_int2,
    dequantize_int4,
    quantize_delta_int4,
    quantize_int1,
    quantize_int2,
    quantize_int4,
    round_mean_int4,
    round_mean_step_int4,
)
from ddiloco.kernels._nesterov import nesterov_step
from ddiloco.kernels._parallelism import PARALLEL_ELEMENTS_MIN, warmup_sizes
from ddiloco.kernels._segments import (
    nesterov_step_segments,
    rda_accumulate,
    rda_accumulate_int4,
    rda_accumulate_round,
    rda_accumulate_round_int4,
    segment_sumsq,
    segment_sumsq_int4,
)
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
    "apply_delta_int4",
    "count_nonfinite",
    "dequantize_int1",
    "dequantize_int2",
    "dequantize_int4",
    "from_bf16",
    "nesterov_step",
    "nesterov_step_segments",
    "quantize_delta_int4",
    "quantize_int1",
    "quantize_int2",
    "quantize_int4",
    "rda_accumulate",
    "rda_accumulate_int4",
    "rda_accumulate_round",
    "rda_accumulate_round_int4",
    "round_mean",
    "round_mean_int4",
    "round_mean_step",
    "round_mean_step_int4",
    "segment_sumsq",
    "segment_sumsq_int4",
    "to_bf16",
    "warmup",
    "warmup_sizes",
]
