"""The syncer's configuration: one frozen, validated value, the first line of the daemon's log.

`ddiloco syncer`'s settings (its flags, `DDILOCO_*` variables and TOML file: `cli.settings`) reach
these fields through `from_mapping`; nothing else changes them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ddiloco.core.codec import Codec
from ddiloco.core.grace import GraceConfig
from ddiloco.core.layout import FRAGMENTS_MAX, Strategy
from ddiloco.core.merge import MergeMethod
from ddiloco.core.outer import OuterConfig
from ddiloco.core.shards import check_shard
from ddiloco.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration value that cannot work; the message names the field."""


@dataclass(frozen=True)
class SyncerConfig:
    num_fragments: int = 4  # P
    period: int = 4  # H, steps between two syncs of one fragment
    strategy: Strategy = Strategy.BALANCED
    block: int = 128  # values per int4 scale
    quorum: int = 1  # K
    merge: MergeMethod = MergeMethod.RDA
    outer: OuterConfig = field(default_factory=OuterConfig)
    grace: GraceConfig = field(default_factory=GraceConfig)
    push_codecs: tuple[str, ...] = ("int4", "bf16", "fp32", "int2", "int1")
    # The codec of the deltas of the published copy a learner reconstructs (core.publish); a learner
    # that does not hold the previous version gets the published copy whole, in fp32.
    broadcast_codec: Codec = Codec.INT4
    learners_max: int = 256
    decisions_kept: int = 64
    checkpoint_every_merges: int = 0  # 0: never by count
    checkpoint_every_s: float = 300.0  # 0: never by time (checkpoints need a directory too)
    # A sharded syncer (core.shards): this process is shard `shard` of `shards` and owns fragments
    # p with p mod shards == shard; 0 of 1 is the whole syncer.
    shard: int = 0
    shards: int = 1

    def __post_init__(self) -> None:
        _int_in("num_fragments", self.num_fragments, 1, FRAGMENTS_MAX)
        _int_in("period", self.period, 1, 1_000_000)
        _int_in("block", self.block, 8, 1 << 20)
        if self.block % 8:
            raise ConfigError(f"block must be a multiple of 8, got {self.block}")
        _int_in("quorum", self.quorum, 1, self.learners_max)
        _int_in("learners_max", self.learners_max, 1, 65_536)
        _int_in("decisions_kept", self.decisions_kept, 1, 100_000)
        _int_in("checkpoint_every_merges", self.checkpoint_every_merges, 0, 10**9)
        wrong = check_shard(self.shard, self.shards, self.num_fragments)
        if wrong is not None:
            raise ConfigError(wrong)
        if not (math.isfinite(self.checkpoint_every_s) and self.checkpoint_every_s >= 0):
            raise ConfigError(f"checkpoint_every_s must be a non-negative number, got {self.checkpoint_every_s!r}")
        for name, kind in (("strategy", Strategy), ("merge", MergeMethod), ("broadcast_codec", Codec)):
            try:
                object.__setattr__(self, name, kind(getattr(self, name)))
            except ValueError:
                raise ConfigError(f"{name} {getattr(self, name)!r} is not one of {[k.value for k in kind]}") from None
        if self.broadcast_codec not in (Codec.INT4, Codec.BF16, Codec.FP32):
            raise ConfigError(f"broadcast_codec must be int4, bf16 or fp32, got {self.broadcast_codec.value}")
        bad = [c for c in self.push_codecs if c not in {k.value for k in Codec}]
        if bad or not self.push_codecs:
            raise ConfigError(f"push_codecs {self.push_codecs!r}: unknown {bad}" if bad else "push_codecs is empty")
        object.__setattr__(self, "push_codecs", tuple(self.push_codecs))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in ("strategy", "merge", "broadcast_codec"):
            out[name] = getattr(self, name).value
        out["push_codecs"] = list(self.push_codecs)
        return out


def from_mapping(values: Mapping[str, Any]) -> SyncerConfig:
    """Build a config from a flat or nested mapping (TOML tables `outer` and `grace` are nested)."""
    values = dict(values)
    known = {f.name for f in dataclasses.fields(SyncerConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown syncer config keys {unknown}; known: {sorted(known)}")
    try:
        if isinstance(values.get("outer"), Mapping):
            values["outer"] = OuterConfig(**values["outer"])
        if isinstance(values.get("grace"), Mapping):
            values["grace"] = GraceConfig(**values["grace"])
        if "push_codecs" in values:
            values["push_codecs"] = tuple(values["push_codecs"])
        return SyncerConfig(**values)
    except TypeError as exc:
        raise ConfigError(f"bad syncer config: {exc}") from exc


def _int_in(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
