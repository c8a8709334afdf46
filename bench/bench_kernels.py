"""pytest-benchmark versions of the merge kernels, each beside its numpy reference.

Run with `pytest bench/ --benchmark-only`. Vectors are 4M float32 (16 MiB), large enough to stream
from memory on most machines and small enough for many rounds; `ddiloco bench merge` gives the full
table at 64M with the bandwidth ceiling and the torch comparison.
"""

import numpy as np
import pytest

from ddiloco import kernels
from ddiloco.kernels import reference

ELEMENTS = 1 << 22
BLOCK = kernels.BLOCK_DEFAULT


@pytest.fixture(scope="module")
def data():
    kernels.warmup()
    rng = np.random.default_rng(0)
    x = rng.standard_normal(ELEMENTS).astype(np.float32)
    codes, scales = kernels.quantize_int4(x, BLOCK)
    weights = rng.lognormal(0.0, 1.5, 256)  # a fragment of 256 tensors of uneven sizes
    sizes = np.floor(weights / weights.sum() * (ELEMENTS - 100)).astype(np.int64)
    offsets = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return {
        "x": x,
        "acc": np.full(ELEMENTS, 0.0, dtype=np.float32),
        "theta": rng.standard_normal(ELEMENTS).astype(np.float32),
        "buf": np.full(ELEMENTS, 0.0, dtype=np.float32),
        "out": np.full(ELEMENTS, 0.0, dtype=np.float32),
        "codes": codes,
        "scales": scales,
        "offsets": offsets,
        "norms": np.sqrt(kernels.segment_sumsq(x, offsets)),
        "weights": np.full(4, 0.25),
        "residual": np.full(ELEMENTS, 0.0, dtype=np.float32),
    }


CALLS = {
    "accumulate": lambda m, d: m.accumulate(d["acc"], 0.25, d["x"]),
    "accumulate_int4": lambda m, d: m.accumulate_int4(d["acc"], 0.25, d["codes"], d["scales"], BLOCK),
    "rda_accumulate_int4": lambda m, d: m.rda_accumulate_int4(
        d["acc"], 0.25, d["codes"], d["scales"], d["offsets"], d["norms"], BLOCK
    ),
    "segment_sumsq_int4": lambda m, d: m.segment_sumsq_int4(d["codes"], d["scales"], d["offsets"], BLOCK),
    "nesterov_step": lambda m, d: m.nesterov_step(d["theta"], d["buf"], d["x"], 0.7, 0.9),
    "quantize_int4": lambda m, d: m.quantize_int4(d["x"], BLOCK),
    "dequantize_int4": lambda m, d: m.dequantize_int4(d["codes"], d["scales"], BLOCK, out=d["out"]),
    "to_bf16": lambda m, d: m.to_bf16(d["x"]),
    # a round of 4 int4 contributions (the same payload four times) and its outer step, in one pass
    "round_mean_step_int4": lambda m, d: m.round_mean_step_int4(
        d["theta"], d["buf"], d["weights"], [d["codes"]] * 4, [d["scales"]] * 4, 0.7, 0.9, BLOCK
    ),
    "quantize_delta_int4": lambda m, d: m.quantize_delta_int4(d["x"], d["theta"], d["residual"], BLOCK),
    "apply_delta_int4": lambda m, d: m.apply_delta_int4(d["theta"], d["buf"], d["codes"], d["scales"], BLOCK),
    "add_delta_apart_int4": lambda m, d: m.add_delta_apart_int4(d["x"], d["theta"], d["codes"], d["scales"], BLOCK),
}


@pytest.mark.parametrize("impl", ["numba", "numpy"])
@pytest.mark.parametrize("kernel", sorted(CALLS))
def test_kernel(benchmark, data, kernel, impl):
    module = kernels if impl == "numba" else reference
    benchmark.group = kernel
    benchmark(CALLS[kernel], module, data)
