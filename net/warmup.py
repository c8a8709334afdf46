"""The kernels a syncer runs, loaded (from numba's on-disk cache, or compiled) before its first merge.

A restarted syncer holds its layout from the checkpoint, so it knows the size of every fragment, the
codecs it accepts and how it merges: it loads the kernels (and the drivers, serial or parallel, that
those sizes take) that its merges, outer steps and broadcasts run, by running them once on synthetic
rounds through the core's own merge path, the codecs learners push by default first. The learners'
encoders and the fused paths of sizes it does not have stay unloaded.

A syncer that holds no parameters yet learns its sizes from the first hello: it loads everything
(`ddiloco.kernels.warmup`).

Importing this module imports no numba: the first kernel called does, on the warm-up's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from ddiloco import kernels
from ddiloco.core import codec as codecs
from ddiloco.core import merge, outer
from ddiloco.core import publish as publishing
from ddiloco.core.config import SyncerConfig
from ddiloco.core.layout import FragmentSpec, Layout

__all__ = ["FIRST_CODECS", "WARMUP_CONTRIBUTIONS", "syncer_warmup"]

WARMUP_CONTRIBUTIONS = 2  # a round of two: the fused kernels' typed lists of more than one item
FIRST_CODECS = ("int4",)  # what learners push unless told otherwise (learner.sync.SyncConfig.codec)


@dataclass(frozen=True)
class _Contribution:
    """What core.merge reads of a push (its Contribution protocol)."""

    learner: int
    weight: float
    payload: codecs.Encoded


def syncer_warmup(config: SyncerConfig, layout: Layout | None) -> tuple[Callable[[], None], ...]:
    """The warm-up's stages for a syncer with this configuration and layout (None: not known yet),
    for `SyncerServer.start_warmup`: first the codecs the learners push by default (merges wait for
    these), then the other accepted codecs."""
    if layout is None:
        return (kernels.warmup,)
    specs = _one_per_size(layout)
    accepted = [codecs.parse_codec(c) for c in config.push_codecs]
    first = [c for c in accepted if c.value in FIRST_CODECS] or accepted
    rest = [c for c in accepted if c not in first]
    stages = [partial(_warm, config, specs, first, accepted)]
    if rest:
        stages.append(partial(_warm, config, specs, rest, accepted))
    return tuple(stages)


def _one_per_size(layout: Layout) -> tuple[FragmentSpec, ...]:
    """One fragment of each padded size: numba compiles per argument type, the size only picks the
    driver (serial, parallel) and the path (fused or not), so equal sizes load the same kernels."""
    by_size: dict[int, FragmentSpec] = {}
    for spec in layout.fragments:
        by_size.setdefault(spec.padded_size, spec)
    return tuple(by_size.values())


def _warm(
    config: SyncerConfig, specs: tuple[FragmentSpec, ...], warmed: list[codecs.Codec], accepted: list[codecs.Codec]
) -> None:
    """One round of each codec in `warmed` (and one of it mixed with another accepted codec) merged
    and stepped at each size, as the core does."""
    for spec in specs:
        for codec in warmed:
            i = accepted.index(codec)
            payload = _payload(codec, spec.padded_size, config.block)
            payload.all_finite()  # a push's admission
            rounds = [[payload] * WARMUP_CONTRIBUTIONS]
            if len(accepted) > 1 and spec.padded_size >= merge.FUSED_ELEMENTS_MIN:
                # a round of mixed codecs takes the per-contribution path (a smaller fragment always does)
                rounds.append([payload, _payload(accepted[(i + 1) % len(accepted)], spec.padded_size, config.block)])
            for payloads in rounds:
                contributions = [_Contribution(m, 1.0, p) for m, p in enumerate(payloads, start=1)]
                merged, _ = merge.merge_round(contributions, spec, config.merge)
                theta = np.zeros(spec.padded_size, dtype=np.float32)
                outer.update(outer.init(theta), theta, merged, config.outer, donate=True)
        # the broadcast: one delta published (core.publish), as after every merge
        published = np.zeros(spec.padded_size, dtype=np.float32)
        publishing.publish(published, np.ones_like(published), config.broadcast_codec, config.block)


def _payload(codec: codecs.Codec, n: int, block: int) -> codecs.Encoded:
    """A push's payload of `n` elements with nonzero values (a zero outer gradient would take RDA's
    fall-back instead of its own path), built without the learners' encoders."""
    if codec is codecs.Codec.FP32:
        body = np.linspace(-1.0, 1.0, n, dtype=np.float32).tobytes()
        block = 0
    elif codec is codecs.Codec.BF16:
        body = (np.linspace(-1.0, 1.0, n, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
        block = 0
    else:
        scales = np.ones(n // block, dtype=np.float32).tobytes()
        code_bytes = codec.body_bytes(n, block) - len(scales)
        body = scales + (np.arange(code_bytes) % 251).astype(np.uint8).tobytes()
    return codecs.from_body(codec, block, n, body, elements=n)
