"""numba CPU kernels behind validating wrappers, each with a numpy reference.

Every kernel takes 1-D C-contiguous arrays of an exact dtype and raises KernelInputError (a
ValueError) naming the argument when one is wrong; the checks run before any loop, so on error
nothing has been modified. Block codecs take vectors whose length is a multiple of `block`.
All loops release the GIL (the syncer runs them in an executor) and are compiled lazily, or by
warmup(). Every wrapper takes `parallel=True`: False keeps the call on the calling thread (a learner's
codec work beside its training step); results are the same bits either way (see _parallelism).
A round's merge has fused kernels (round_mean*, rda_accumulate_round*, nesterov_step_segments) that
read every contribution once (rda_accumulate_round*_sumsq also give the merged direction's per-tensor
sums of squares, as segment_sumsq would, without another pass), and the learner has one-pass encode and
apply (quantize_delta_int4, apply_delta_int4); the int4 broadcast has its one-pass publish and the learner's apply of it
(publish_delta_int4, add_delta_int4, and add_delta_apart_int4 with the progress a learner keeps). `ddiloco.kernels.reference` holds a plain-numpy version of each with the same signature.
"""

import importlib
import sys

from ddiloco.kernels._checks import BLOCK_DEFAULT
from ddiloco.kernels._errors import KernelInputError

# name -> the private module that defines it. Importing numba takes about a second (it brings scipy
# along), so the kernels' modules are imported on first use, not with this package: the syncer
# daemon imports the core (which names `kernels`) and listens before numba is loaded, and the
# kernels are loaded beside the learners' reconnection (net.server's warm-up thread).
_LAZY = {
    "from_bf16": "_bf16",
    "to_bf16": "_bf16",
    "accumulate": "_dense",
    "all_finite": "_dense",
    "count_nonfinite": "_dense",
    "round_mean": "_dense",
    "round_mean_step": "_dense",
    "accumulate_int1": "_lowbit",
    "accumulate_int2": "_lowbit",
    "accumulate_int4": "_lowbit",
    "add_delta_apart_int4": "_lowbit",
    "add_delta_int4": "_lowbit",
    "apply_delta_int4": "_lowbit",
    "dequantize_int1": "_lowbit",
    "dequantize_int2": "_lowbit",
    "dequantize_int4": "_lowbit",
    "publish_delta_int4": "_lowbit",
    "quantize_delta_int4": "_lowbit",
    "quantize_int1": "_lowbit",
    "quantize_int2": "_lowbit",
    "quantize_int4": "_lowbit",
    "round_mean_int4": "_lowbit",
    "round_mean_step_int4": "_lowbit",
    "nesterov_step": "_nesterov",
    "PARALLEL_ELEMENTS_MIN": "_parallelism",
    "warmup_sizes": "_parallelism",
    "nesterov_step_segments": "_segments",
    "rda_accumulate": "_segments",
    "rda_accumulate_int4": "_segments",
    "rda_accumulate_round": "_segments",
    "rda_accumulate_round_int4": "_segments",
    "rda_accumulate_round_int4_sumsq": "_segments",
    "rda_accumulate_round_sumsq": "_segments",
    "segment_sumsq": "_segments",
    "segment_sumsq_int4": "_segments",
    "warmup": "_warmup",
}


def __getattr__(name: str) -> object:
    """A kernel, imported with its module on first use (PEP 562) and kept as this package's attribute."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def skip_blas_probe() -> None:
    """Spare numba its probe for BLAS: the first kernel a process loads initialises numba's CPU
    target, which imports scipy.linalg only to learn whether np.dot and np.linalg can be compiled
    (about a third of that first call's CPU time, docs/operations.md "Restarts"). No kernel here uses
    them. For a process that imports no scipy of its own (the syncer daemon), before its first kernel:
    scipy.linalg is unimportable afterwards in that process."""
    sys.modules.setdefault("scipy.linalg.cython_blas", None)


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "BLOCK_DEFAULT",
    "PARALLEL_ELEMENTS_MIN",
    "KernelInputError",
    "accumulate",
    "accumulate_int1",
    "accumulate_int2",
    "accumulate_int4",
    "add_delta_apart_int4",
    "add_delta_int4",
    "all_finite",
    "apply_delta_int4",
    "count_nonfinite",
    "dequantize_int1",
    "dequantize_int2",
    "dequantize_int4",
    "from_bf16",
    "nesterov_step",
    "nesterov_step_segments",
    "publish_delta_int4",
    "quantize_delta_int4",
    "quantize_int1",
    "quantize_int2",
    "quantize_int4",
    "rda_accumulate",
    "rda_accumulate_int4",
    "rda_accumulate_round",
    "rda_accumulate_round_int4",
    "rda_accumulate_round_int4_sumsq",
    "rda_accumulate_round_sumsq",
    "round_mean",
    "round_mean_int4",
    "round_mean_step",
    "round_mean_step_int4",
    "segment_sumsq",
    "segment_sumsq_int4",
    "skip_blas_probe",
    "to_bf16",
    "warmup",
    "warmup_sizes",
]
