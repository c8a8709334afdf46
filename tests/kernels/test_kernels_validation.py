"""Bad input: every wrapper raises KernelInputError (a ValueError) naming the argument, and leaves
every array it was handed exactly as it was."""

import numpy as np
import pytest

from ddiloco import kernels

N = 256
F32_MAX = float(np.finfo(np.float32).max)


def arrays():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(N).astype(np.float32)
    codes4, scales4 = kernels.quantize_int4(x)
    codes2, scales2 = kernels.quantize_int2(x)
    codes1, scales1 = kernels.quantize_int1(x)
    offsets = np.array([0, 100, 100, 250], dtype=np.int64)
    return {
        "x": x,
        "acc": rng.standard_normal(N).astype(np.float32),
        "theta": rng.standard_normal(N).astype(np.float32),
        "buf": rng.standard_normal(N).astype(np.float32),
        "codes4": codes4,
        "scales4": scales4,
        "codes2": codes2,
        "scales2": scales2,
        "codes1": codes1,
        "scales1": scales1,
        "u16": kernels.to_bf16(x),
        "offsets": offsets,
        "norms": np.sqrt(kernels.segment_sumsq(x, offsets)),
    }


def strided(a):
    wide = np.repeat(a, 2)
    return wide[::2]


def with_value(a, i, value):
    a = a.copy()
    a[i] = value
    return a


# (id, call(a) using the dict of valid arrays `a`, with exactly one thing wrong, message fragment)
CASES = [
    ("acc-dtype", lambda a: kernels.accumulate(a["acc"].astype(np.float64), 1.0, a["x"]), "acc must have dtype"),
    ("acc-2d", lambda a: kernels.accumulate(a["acc"].reshape(16, 16), 1.0, a["x"]), "acc must be 1-D"),
    ("acc-list", lambda a: kernels.accumulate(a["acc"].tolist(), 1.0, a["x"]), "acc must be a numpy array"),
    ("x-strided", lambda a: kernels.accumulate(a["acc"], 1.0, strided(a["x"])), "x must be C-contiguous"),
    ("x-length", lambda a: kernels.accumulate(a["acc"], 1.0, a["x"][:-1]), "x must have 256"),
    ("weight-nan", lambda a: kernels.accumulate(a["acc"], float("nan"), a["x"]), "weight must be finite"),
    ("weight-inf", lambda a: kernels.accumulate_int4(a["acc"], float("inf"), a["codes4"], a["scales4"]), "weight"),
    ("weight-huge", lambda a: kernels.accumulate(a["acc"], 1e39, a["x"]), "float32 range"),
    ("weight-str", lambda a: kernels.accumulate(a["acc"], "1", a["x"]), "weight must be a real number"),
    ("acc-alias", lambda a: kernels.accumulate(a["acc"], 1.0, a["acc"]), "must not share memory"),
    ("quantize-odd-block", lambda a: kernels.quantize_int4(a["x"], 3), "block must be a positive even"),
    ("quantize-zero-block", lambda a: kernels.quantize_int4(a["x"], 0), "block"),
    ("quantize-float-block", lambda a: kernels.quantize_int4(a["x"], 128.0), "block must be an integer"),
    ("quantize-length", lambda a: kernels.quantize_int4(a["x"][:200]), "not a multiple of block"),
    ("quantize-f64", lambda a: kernels.quantize_int4(a["x"].astype(np.float64)), "x must have dtype float32"),
    ("quantize-nan", lambda a: kernels.quantize_int4(with_value(a["x"], 7, np.nan)), "NaN or Inf"),
    ("int2-block", lambda a: kernels.quantize_int2(a["x"], 6), "multiple of 4"),
    ("int1-block", lambda a: kernels.quantize_int1(a["x"], 12), "multiple of 8"),
    ("int1-inf", lambda a: kernels.quantize_int1(with_value(a["x"], 0, -np.inf)), "NaN or Inf"),
    ("codes-length", lambda a: kernels.accumulate_int4(a["acc"], 1.0, a["codes4"][:-1], a["scales4"]), "codes must"),
    ("codes-dtype", lambda a: kernels.accumulate_int4(a["acc"], 1.0, a["codes4"].view(np.int8), a["scales4"]), "codes"),
    ("scales-length", lambda a: kernels.accumulate_int4(a["acc"], 1.0, a["codes4"], a["scales4"][:1]), "scales must"),
    (
        "scales-nan",
        lambda a: kernels.accumulate_int4(a["acc"], 1.0, a["codes4"], with_value(a["scales4"], 1, np.nan)),
        "scales",
    ),
    (
        "scales-neg",
        lambda a: kernels.accumulate_int2(a["acc"], 1.0, a["codes2"], with_value(a["scales2"], 0, -1.0)),
        "non-negative",
    ),
    (
        "scales-inf",
        lambda a: kernels.accumulate_int1(a["acc"], 1.0, a["codes1"], with_value(a["scales1"], 0, np.inf)),
        "scales",
    ),
    ("block-mismatch", lambda a: kernels.accumulate_int4(a["acc"], 1.0, a["codes4"], a["scales4"], 64), "scales must"),
    (
        "acc-not-blocked",
        lambda a: kernels.accumulate_int4(a["acc"][:200], 1.0, a["codes4"], a["scales4"]),
        "not a multiple",
    ),
    (
        "acc-readonly",
        lambda a: kernels.accumulate_int4(readonly(a["acc"]), 1.0, a["codes4"], a["scales4"]),
        "writeable",
    ),
    (
        "dequantize-out-dtype",
        lambda a: kernels.dequantize_int4(a["codes4"], a["scales4"], out=a["acc"].astype(np.float64)),
        "out",
    ),
    (
        "dequantize-out-length",
        lambda a: kernels.dequantize_int2(a["codes2"], a["scales2"], out=a["acc"][:128]),
        "out must",
    ),
    ("bf16-dtype", lambda a: kernels.from_bf16(a["u16"].view(np.int16)), "u must have dtype uint16"),
    ("bf16-out", lambda a: kernels.to_bf16(a["x"], out=np.zeros(N, np.uint32)), "out must have dtype"),
    (
        "offsets-dtype",
        lambda a: kernels.segment_sumsq(a["x"], a["offsets"].astype(np.int32)),
        "offsets must have dtype int64",
    ),
    ("offsets-start", lambda a: kernels.segment_sumsq(a["x"], a["offsets"] + 1), "offsets must start at 0"),
    ("offsets-order", lambda a: kernels.segment_sumsq(a["x"], a["offsets"][[0, 3, 1, 2]].copy()), "non-decreasing"),
    ("offsets-past-end", lambda a: kernels.segment_sumsq(a["x"], with_value(a["offsets"], 3, N + 1)), "past the"),
    ("offsets-empty", lambda a: kernels.segment_sumsq(a["x"], np.zeros(0, np.int64)), "at least one"),
    (
        "sumsq4-offsets",
        lambda a: kernels.segment_sumsq_int4(a["codes4"], a["scales4"], with_value(a["offsets"], 3, N + 1)),
        "past",
    ),
    (
        "rda-norms-length",
        lambda a: kernels.rda_accumulate(a["acc"], 1.0, a["x"], a["offsets"], a["norms"][:2]),
        "norms must",
    ),
    (
        "rda-norms-nan",
        lambda a: kernels.rda_accumulate(a["acc"], 1.0, a["x"], a["offsets"], with_value(a["norms"], 0, np.nan)),
        "norms",
    ),
    (
        "rda-norms-neg",
        lambda a: kernels.rda_accumulate(a["acc"], 1.0, a["x"], a["offsets"], with_value(a["norms"], 2, -1.0)),
        "norms",
    ),
    (
        "rda-norms-f32",
        lambda a: kernels.rda_accumulate(a["acc"], 1.0, a["x"], a["offsets"], a["norms"].astype(np.float32)),
        "norms",
    ),
    (
        "rda-x-length",
        lambda a: kernels.rda_accumulate(a["acc"], 1.0, a["x"][:128], a["offsets"][:2], a["norms"][:1]),
        "x must",
    ),
    (
        "rda4-block",
        lambda a: kernels.rda_accumulate_int4(a["acc"], 1.0, a["codes4"], a["scales4"], a["offsets"], a["norms"], 5),
        "block",
    ),
    (
        "rda4-weight",
        lambda a: kernels.rda_accumulate_int4(a["acc"], np.nan, a["codes4"], a["scales4"], a["offsets"], a["norms"]),
        "weight",
    ),
    ("nesterov-g-length", lambda a: kernels.nesterov_step(a["theta"], a["buf"], a["x"][:10], 0.7, 0.9), "g must"),
    (
        "nesterov-buf-dtype",
        lambda a: kernels.nesterov_step(a["theta"], a["buf"].astype(np.float16), a["x"], 0.7, 0.9),
        "buf",
    ),
    (
        "nesterov-lr",
        lambda a: kernels.nesterov_step(a["theta"], a["buf"], a["x"], float("nan"), 0.9),
        "lr must be finite",
    ),
    ("nesterov-mu", lambda a: kernels.nesterov_step(a["theta"], a["buf"], a["x"], 0.7, None), "mu must be a real"),
    ("nesterov-alias", lambda a: kernels.nesterov_step(a["theta"], a["theta"][::1], a["x"], 0.7, 0.9), "share memory"),
    (
        "nesterov-overlap",
        lambda a: kernels.nesterov_step(a["theta"][:128], a["theta"][64:192], a["x"][:128], 0.7, 0.9),
        "share",
    ),
    ("count-strided", lambda a: kernels.all_finite(strided(a["x"])), "C-contiguous"),
]


def readonly(a):
    a = a.view()
    a.flags.writeable = False
    return a


@pytest.mark.parametrize(("call", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_and_modifies_nothing(call, message):
    a = arrays()
    before = {name: value.copy() for name, value in a.items()}
    with pytest.raises(kernels.KernelInputError, match=message) as info:
        call(a)
    assert isinstance(info.value, ValueError)
    for name, value in a.items():
        assert value.tobytes() == before[name].tobytes(), f"{name} was modified"


def test_valid_calls_on_the_same_arrays_pass():
    # the fixtures above are valid apart from the one thing each case breaks
    a = arrays()
    kernels.accumulate(a["acc"], 1.0, a["x"])
    kernels.accumulate_int4(a["acc"], 1.0, a["codes4"], a["scales4"])
    kernels.accumulate_int2(a["acc"], 1.0, a["codes2"], a["scales2"])
    kernels.accumulate_int1(a["acc"], 1.0, a["codes1"], a["scales1"])
    kernels.rda_accumulate(a["acc"], 1.0, a["x"], a["offsets"], a["norms"])
    kernels.rda_accumulate_int4(a["acc"], 1.0, a["codes4"], a["scales4"], a["offsets"], a["norms"])
    kernels.segment_sumsq_int4(a["codes4"], a["scales4"], a["offsets"])
    kernels.nesterov_step(a["theta"], a["buf"], a["x"], 0.7, 0.9)
    kernels.accumulate(a["acc"], F32_MAX, np.zeros(N, np.float32))  # the float32 maximum is allowed
    assert np.isfinite(a["acc"]).all()
