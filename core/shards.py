"""Which syncer shard owns which fragment: the one rule every shard and every learner shares.

A syncer can be split into N shards (`ddiloco syncer --shard i --shards N`), each a process of its
own with its own checkpoint, tape and metrics, holding only the fragments it owns. Fragment p belongs
to shard p mod N. The layout already cuts the model into fragments of near-equal size, so dealing
them round robin balances both the memory and the work; and because the round schedule staggers
fragment p's rounds by p (core.schedule), consecutive rounds fall on different shards.

The rule is fixed for a run: a checkpoint names its shard and the shard count, and a shard refuses
to resume another shard's checkpoint (docs/protocol.md, "A sharded syncer").
"""

from __future__ import annotations

__all__ = ["SHARDS_MAX", "check_shard", "owned", "owner"]

# More shards than this would each hold a sliver of a model and multiply every learner's connections.
SHARDS_MAX = 64


def check_shard(shard: int, shards: int, num_fragments: int) -> str | None:
    """What is wrong with shard `shard` of `shards` for a model of `num_fragments` fragments, or None."""
    if not 1 <= shards <= SHARDS_MAX:
        return f"the shard count must lie in [1, {SHARDS_MAX}], got {shards}"
    if not 0 <= shard < shards:
        return f"the shard index must lie in [0, {shards - 1}] for {shards} shards, got {shard}"
    if shards > num_fragments:
        return f"{shards} shards need at least {shards} fragments, the syncer has {num_fragments}"
    return None


def owner(fragment: int, shards: int) -> int:
    """The shard that owns `fragment`."""
    return fragment % shards


def owned(shard: int, shards: int, num_fragments: int) -> tuple[int, ...]:
    """The fragments shard `shard` of `shards` owns, in order."""
    return tuple(range(shard, num_fragments, shards))
