from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core import codec
from ddiloco.core.layout import TensorSpec, build_layout
from ddiloco.core.merge import merge


def one_fragment(sizes, embedding=()):
    ts = [TensorSpec(f"t{i}", (s,), embedding=(i in embedding)) for i, s in enumerate(sizes)]
    return build_layout(ts, 1, block=128).fragments[0]


@dataclass(frozen=True)
class Part:
    """A contribution of a given weight (core.merge.Contribution; the syncer's are its pushes)."""

    learner: int
    weight: float
    payload: codec.Encoded


def contrib(learner, weight, vec, name="fp32"):
    return Part(learner, weight, codec.parse(codec.encode(vec, name)))


def padded(frag, *parts):
    v = np.zeros(frag.padded_size, dtype=np.float32)
    v[: frag.size] = np.concatenate(parts)
    return v


def reference_rda(vectors, weights, frag):
    """Straight from docs/algorithm.md: per tensor, weighted mean norm times unit of weighted mean unit."""
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    out = np.zeros(frag.padded_size)
    for seg in frag.segments:
        lo, hi = seg.offset, seg.stop
        vs = [v[lo:hi].astype(np.float64) for v in vectors]
        norms = [np.linalg.norm(v) for v in vs]
        if seg.tensor.embedding:
            out[lo:hi] = sum(wi * v for wi, v in zip(w, vs))
            continue
        units = [v / n if n > 0 else np.zeros_like(v) for v, n in zip(vs, norms)]
        direction = sum(wi * u for wi, u in zip(w, units))
        radial = sum(wi * n for wi, n in zip(w, norms))
        out[lo:hi] = radial * direction / np.linalg.norm(direction)
    return out


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(1, 6), data=st.data())
def test_rda_matches_formula_and_is_permutation_invariant(seed, m, data):
    rng = np.random.default_rng(seed)
    frag = one_fragment([130, 7, 64], embedding=(1,))
    vecs = [padded(frag, *(rng.standard_normal(s).astype(np.float32) for s in (130, 7, 64))) for _ in range(m)]
    weights = list(rng.uniform(0.1, 5.0, m))
    cs = [contrib(i + 1, w, v) for i, (w, v) in enumerate(zip(weights, vecs))]
    got, info = merge(cs, frag, "rda")
    np.testing.assert_allclose(got, reference_rda(vecs, weights, frag), rtol=2e-4, atol=2e-5)
    assert not got[frag.size :].any()
    shuffled = data.draw(st.permutations(cs))
    again, _ = merge(shuffled, frag, "rda")
    np.testing.assert_array_equal(again, got)  # summation in learner order: bit-identical
    assert sum(info.weights) == pytest.approx(1.0)


def test_mean_and_zero_weight_learners_ignored():
    frag = one_fragment([256])
    a, b = (np.full(256, x, dtype=np.float32) for x in (1.0, 3.0))
    got, info = merge(
        [contrib(1, 1.0, a), contrib(2, 3.0, b), contrib(3, 0.0, np.full(256, 1e6, dtype=np.float32))], frag, "mean"
    )
    np.testing.assert_allclose(got, 0.25 * 1 + 0.75 * 3)
    assert info.learners == (1, 2)


def test_rda_keeps_norm_of_orthogonal_vectors_mean_shrinks():
    m, n = 8, 1024
    frag = one_fragment([n])
    eye = np.eye(n, dtype=np.float32)[:m] * 2.0  # equal norm 2, orthogonal
    cs = [contrib(i + 1, 1.0, eye[i]) for i in range(m)]
    rda, _ = merge(cs, frag, "rda")
    mean, _ = merge(cs, frag, "mean")
    assert np.linalg.norm(rda) == pytest.approx(2.0, rel=1e-5)
    assert np.linalg.norm(mean) == pytest.approx(2.0 / np.sqrt(m), rel=1e-5)


def test_rda_falls_back_to_mean_when_direction_vanishes():
    frag = one_fragment([128, 128])
    v = np.random.default_rng(1).standard_normal(256).astype(np.float32)
    w = v.copy()
    w[:128] = -v[:128]  # tensor 0 cancels exactly, tensor 1 agrees
    got, info = merge([contrib(1, 1.0, v), contrib(2, 1.0, w)], frag, "rda")
    assert info.mean_fallback_tensors == ("t0",)
    np.testing.assert_allclose(got[:128], 0.0, atol=1e-6)
    np.testing.assert_allclose(got[128:], v[128:], rtol=1e-5)


def test_rda_falls_back_on_several_tensors_with_the_weighted_mean_of_each():
    frag = one_fragment([128, 256, 128])
    rng = np.random.default_rng(2)
    v = rng.standard_normal(512).astype(np.float32)
    w = rng.standard_normal(512).astype(np.float32)
    w[:128], w[384:] = -v[:128], -v[384:]  # tensors 0 and 2 cancel exactly (equal weights: direction 0)
    got, info = merge([contrib(1, 1.0, v), contrib(2, 1.0, w)], frag, "rda")
    assert info.mean_fallback_tensors == ("t0", "t2")
    np.testing.assert_allclose(got[:128], 0.0, atol=1e-6)
    np.testing.assert_allclose(got[384:], 0.0, atol=1e-6)
    zero = np.zeros(512, dtype=np.float32)
    got, info = merge([contrib(1, 1.0, zero), contrib(2, 3.0, zero.copy())], frag, "rda")
    assert info.mean_fallback_tensors == ("t0", "t1", "t2")  # all-zero outer gradients: every tensor
    np.testing.assert_array_equal(got, 0.0)
    a, b, c = zero.copy(), zero.copy(), zero.copy()
    # weights 1:1:2 and tensor 0's directions +, +, -: their weighted unit vectors cancel, so it
    # takes the weighted mean of the values (1 + 3 - 2 * 0.5) / 4; tensor 2 is zero in all three
    a[:128], b[:128], c[:128] = 1.0, 3.0, -0.5
    a[128:384] = b[128:384] = c[128:384] = v[128:384]
    got, info = merge([contrib(1, 1.0, a), contrib(2, 1.0, b), contrib(3, 2.0, c)], frag, "rda")
    assert info.mean_fallback_tensors == ("t0", "t2")
    np.testing.assert_allclose(got[:128], 0.75, rtol=1e-5)
    np.testing.assert_allclose(got[128:384], v[128:384], rtol=1e-5)
    np.testing.assert_array_equal(got[384:], 0.0)


def test_int4_contributions_merge_like_their_decoded_values():
    rng = np.random.default_rng(2)
    frag = one_fragment([500, 12])
    vecs = [
        padded(frag, rng.standard_normal(500).astype(np.float32), rng.standard_normal(12).astype(np.float32))
        for _ in range(3)
    ]
    cs = [contrib(i, 1.0 + i, v, "int4") for i, v in enumerate(vecs)]
    decoded = [c.payload.decode() for c in cs]
    got, _ = merge(cs, frag, "rda")
    np.testing.assert_allclose(got, reference_rda(decoded, [1.0, 2.0, 3.0], frag), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("name", ["int4", "fp32", "bf16"])
def test_a_round_of_one_contribution_merges_to_it_exactly_and_in_one_fused_pass(name):
    # RDA of one vector is the vector (radius its norm, direction its own): the merge gives its decoded
    # bits whatever its token weight, zero and embedding tensors included, with nothing left to scale
    from ddiloco.core import merge as merging

    sizes = [270000, 300, 9000, 130]
    frag = one_fragment(sizes, embedding=(1,))
    rng = np.random.default_rng(11)
    v = padded(frag, *(rng.standard_normal(s).astype(np.float32) * np.float32(0.01) for s in sizes))
    v[270300:279300] = 0.0
    c = contrib(4, 3.7, v, name)
    merged, info = merging.merge_round([c], frag, "rda")
    assert merged.summed is None and merged.factors is None  # the mean's fused pass, not RDA's three
    assert info == merging.MergeInfo((4,), (1.0,), ())
    np.testing.assert_array_equal(merged.values(), c.payload.decode())
    np.testing.assert_array_equal(merge([c], frag, "rda")[0], merge([c], frag, "mean")[0])


def test_bad_merges():
    frag = one_fragment([256])
    with pytest.raises(ValueError, match="positive weight"):
        merge([contrib(1, 0.0, np.zeros(256, dtype=np.float32))], frag)
    with pytest.raises(ValueError, match="duplicate learner"):
        merge([contrib(1, 1.0, np.zeros(256, dtype=np.float32))] * 2, frag)
    with pytest.raises(ValueError, match="payload of 128 elements"):
        merge([contrib(1, 1.0, np.zeros(128, dtype=np.float32))], frag)


@pytest.mark.parametrize("method", ["mean", "rda"])
@pytest.mark.parametrize(
    "codecs", [("int4",) * 4, ("fp32",) * 3, ("bf16", "bf16"), ("int4", "fp32", "int4"), ("int2",) * 2]
)
def test_the_fused_round_steps_like_the_merged_values_bit_for_bit(method, codecs):
    # what the syncer does (merge_round, then outer.update fusing the rest of the merge into the step)
    # against the plain path (merge's values, then the step): the same bits, on a fragment large enough
    # for the fused kernels, with an embedding tensor, a tensor that falls back to the mean, and padding
    from ddiloco.core import merge as merging
    from ddiloco.core import outer

    sizes = [270000, 300, 9000, 130]
    frag = one_fragment(sizes, embedding=(1,))
    assert frag.padded_size >= merging.FUSED_ELEMENTS_MIN
    rng = np.random.default_rng(7)
    vecs = [padded(frag, *(rng.standard_normal(s).astype(np.float32) for s in sizes)) for _ in codecs]
    for v in vecs:
        v[270300:279300] = 0.0  # tensor 2 is zero everywhere: its RDA direction vanishes
    cs = [contrib(i + 1, 2.0 if i < 2 else 1.0 + i, v, name) for i, (v, name) in enumerate(zip(vecs, codecs))]
    delta, info = merge(cs, frag, method)
    merged, info_fused = merging.merge_round(cs, frag, method)
    assert info_fused == info
    np.testing.assert_array_equal(merged.values(), delta)
    theta = rng.standard_normal(frag.padded_size).astype(np.float32)
    state = outer.NesterovState(buf=rng.standard_normal(frag.padded_size).astype(np.float32))
    config = outer.OuterConfig()
    want_theta, want_state = outer.update(state, theta, delta, config)
    got_theta, got_state = outer.update(state, theta, merged, config)
    np.testing.assert_array_equal(got_theta, want_theta)
    np.testing.assert_array_equal(got_state.buf, want_state.buf)
    if codecs[0] != "int2":  # int2 has no zero level: blocks shared with tensor 1 decode to +-scale
        assert info.mean_fallback_tensors == (("t2",) if method == "rda" else ())


@pytest.mark.parametrize("codecs", [("int4",) * 3, ("fp32",) * 2])
def test_the_fused_rda_takes_the_directions_norms_with_the_bits_of_a_separate_pass(codecs, monkeypatch):
    # the fused round's accumulate gives the sums of squares of the merged direction as it goes; with
    # the fused kernels switched off, the accumulate per contribution and segment_sumsq after it
    from ddiloco.core import merge as merging

    sizes = [200000, 300, 0, 70000, 130]
    frag = one_fragment(sizes, embedding=(1,))
    rng = np.random.default_rng(3)
    vecs = [padded(frag, *(rng.standard_normal(s).astype(np.float32) for s in sizes)) for _ in codecs]
    cs = [contrib(i + 1, 1.0 + i, v, name) for i, (v, name) in enumerate(zip(vecs, codecs))]
    assert frag.padded_size >= merging.FUSED_ELEMENTS_MIN
    fused, info = merging.merge_round(cs, frag)
    monkeypatch.setattr(merging, "FUSED_ELEMENTS_MIN", frag.padded_size + 1)
    apart, info_apart = merging.merge_round(cs, frag)
    assert info_apart == info
    np.testing.assert_array_equal(fused.summed.view(np.uint32), apart.summed.view(np.uint32))
    np.testing.assert_array_equal(fused.factors.view(np.uint32), apart.factors.view(np.uint32))
