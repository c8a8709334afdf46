"""The delta broadcast: the syncer's published copy of a fragment and the deltas that keep it close.

docs/protocol.md, "Delta broadcast". Per fragment the syncer keeps a *published* copy (float32): what
every learner that follows the broadcast reconstructs, bit for bit. For each new version it encodes
delta = global - published with the broadcast codec and adds the decoded delta to published, with the
same kernel and the same float32 operations a learner uses to apply it (`apply`). The quantisation
error of one version stays in global - published and goes out with the next delta: error feedback on
the syncer, with no residual of its own. So the published copy stays within one quantisation step of
the global one, and a learner that applied every delta holds exactly the bytes of one that received
the published copy whole.

Pure: numpy in, numpy out; nothing here knows of versions or connections (core.syncer, net.shell).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddiloco import kernels
from ddiloco.core import codec as codecs

__all__ = ["BROADCAST_CODECS", "Delta", "apply", "apply_apart", "publish", "warm_up"]

BROADCAST_CODECS = (codecs.Codec.INT4, codecs.Codec.BF16, codecs.Codec.FP32)  # the first is the default


@dataclass(frozen=True)
class Delta:
    """One version's delta of a fragment as it goes out: the codec body (int4: float32 scales then
    codes; bf16: uint16 bits; fp32: float32), its codec and block (0 for the dense codecs), and the
    version it applies onto."""

    codec: codecs.Codec
    block: int
    base_version: int
    body: np.ndarray  # read-only, 1-D; the bytes of the codec body

    def encoded(self, elements: int) -> codecs.Encoded:
        """The delta as a parsed payload (views into `body`)."""
        return codecs.from_body(self.codec, self.block, elements, memoryview(self.body).cast("B"))


def publish(
    published: np.ndarray, theta: np.ndarray, codec: codecs.Codec, block: int, *, parallel: bool = True
) -> tuple[np.ndarray, int]:
    """Encode theta - published with `codec` and add the decoded delta to `published` in place.
    Returns (codec body, block as sent: 0 for fp32 and bf16). Both are float32[n], n a multiple of
    `block` for int4."""
    if codec is codecs.Codec.INT4:
        codes, scales = kernels.publish_delta_int4(published, theta, block, parallel=parallel)
        body = np.concatenate([scales.view(np.uint8), codes])
        return _read_only(body), block
    delta = theta - published
    if codec is codecs.Codec.BF16:
        bits = kernels.to_bf16(delta, parallel=parallel)
        published += kernels.from_bf16(bits, parallel=parallel)
        return _read_only(bits), 0
    assert codec is codecs.Codec.FP32, f"no broadcast codec {codec}"
    published += delta
    return _read_only(delta), 0


def apply(published: np.ndarray, delta: codecs.Encoded, *, parallel: bool = True) -> None:
    """A learner's side: published += decode(delta) in place, the same bits as `publish` leaves."""
    if delta.codec is codecs.Codec.INT4:
        kernels.add_delta_int4(published, delta.data, delta.scales, delta.block, parallel=parallel)
    elif delta.codec is codecs.Codec.BF16:
        published += kernels.from_bf16(delta.data, parallel=parallel)
    else:
        assert delta.codec is codecs.Codec.FP32, f"no broadcast codec {delta.codec}"
        published += delta.data


def apply_apart(
    onto: np.ndarray, delta: codecs.Encoded, anchor: np.ndarray, *, parallel: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """A learner's side, as new arrays: (published, difference), published the bits `apply` leaves
    in a copy of `onto` and difference = published - anchor; int4 in one pass over the fragment."""
    if delta.codec is codecs.Codec.INT4:
        return kernels.add_delta_apart_int4(onto, anchor, delta.data, delta.scales, delta.block, parallel=parallel)
    published = onto.copy()
    apply(published, delta, parallel=parallel)
    return published, published - anchor


def warm_up(block: int = kernels.BLOCK_DEFAULT) -> None:
    """Compile (or load from numba's cache) the kernels a learner applies deltas with, serial and
    parallel drivers alike, before it joins (see codec.warm_up: a kernel compiled on first use holds
    the GIL for seconds)."""
    for n in kernels.warmup_sizes(block):
        published = np.zeros(n, dtype=np.float32)
        theta = np.linspace(-1.0, 1.0, n, dtype=np.float32)
        for c in BROADCAST_CODECS:
            body, b = publish(published, theta, c, block)
            for parallel in (True, False):
                delta = codecs.from_body(c, b, n, memoryview(body).cast("B"))
                apply(published.copy(), delta, parallel=parallel)
                apply_apart(published, delta, theta, parallel=parallel)


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a
