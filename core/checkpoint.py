"""The syncer's checkpoint format: a manifest and raw arrays, content hashed, no pickle.

A checkpoint holds what a resumed syncer needs to continue with no lost merge: the config, the
layout, every fragment's parameters, momentum, version and round counter, the global step, the
counters and the token ledger's books. Learners are not in it: they reconnect by themselves (their
open token windows are booked as lost, they were never merged).

File layout (little-endian):

    0    8    magic b"DDCKPT01"
    8    8    manifest bytes M
    16   M    manifest, JSON (orjson): fields below, and "arrays": [{name, dtype, shape, offset, nbytes, sha256}]
    ...       zero padding to a multiple of 64, then each array's raw bytes at its offset
              (offsets are from the start of the file, 64-byte aligned)
    end-32 32 sha256 of every byte before it

Writing the file atomically (temp file, fsync, rename) is the shell's job; this module only turns a
state into bytes and bytes back into a state, refusing anything that does not check out.
"""

from __future__ import annotations

import hashlib
import struct
from collections import deque
from typing import Iterable

import numpy as np
import orjson

from ddiloco.core.config import from_mapping
from ddiloco.core.grace import Timing
from ddiloco.core.layout import layout_from_description
from ddiloco.core.ledger import FATES, Ledger
from ddiloco.core.outer import NesterovState
from ddiloco.core.syncer import SyncerState, new_state
from ddiloco.errors import UserError

MAGIC = b"DDCKPT01"
FORMAT = 1
_ALIGN = 64
_DIGEST_BYTES = 32
MANIFEST_BYTES_MAX = 64 << 20


class CheckpointError(UserError, ValueError):
    """A checkpoint that is corrupt, truncated or of another format; the message says which."""


def to_chunks(state: SyncerState) -> list[bytes | memoryview]:
    """The checkpoint as a list of byte chunks (arrays are not copied) ending in the digest."""
    if not state.holds_parameters:
        raise CheckpointError("the syncer holds no parameters yet: nothing to checkpoint")
    arrays = []
    for p, frag in enumerate(state.fragments):
        arrays += [(f"theta/{p}", frag.theta), (f"momentum/{p}", frag.momentum.buf)]
    manifest = _manifest(state)
    hashes = [hashlib.sha256(memoryview(arr)).hexdigest() for _, arr in arrays]
    # The offsets depend on the manifest's own length, which depends on the offsets: iterate to the
    # fixed point (two rounds at most in practice).
    entries, header_len = [], 0
    for _ in range(4):
        offset = _aligned(16 + header_len)
        entries = []
        for (name, arr), sha in zip(arrays, hashes):
            entries.append(
                {"name": name, "dtype": "float32", "shape": [int(arr.size)], "offset": offset,
                 "nbytes": int(arr.nbytes), "sha256": sha}
            )
            offset = _aligned(offset + arr.nbytes)
        body = orjson.dumps({**manifest, "arrays": entries})
        if len(body) == header_len:
            break
        header_len = len(body)
    assert len(body) == header_len, "checkpoint manifest layout did not converge"
    chunks: list[bytes | memoryview] = [MAGIC, struct.pack("<Q", len(body)), body]
    position = 16 + len(body)
    for entry, (_, arr) in zip(entries, arrays):
        chunks.append(b"\0" * (entry["offset"] - position))
        chunks.append(memoryview(arr).cast("B"))
        position = entry["offset"] + arr.nbytes
    digest = hashlib.sha256()
    for c in chunks:
        digest.update(c)
    chunks.append(digest.digest())
    return chunks


def restore(buf: bytes | bytearray | memoryview) -> SyncerState:
    """A syncer state from checkpoint bytes; raises CheckpointError on any mismatch."""
    view = memoryview(buf).cast("B")
    if view.nbytes < 16 + _DIGEST_BYTES or bytes(view[:8]) != MAGIC:
        raise CheckpointError("not a ddiloco checkpoint (bad magic or too short)")
    if hashlib.sha256(view[:-_DIGEST_BYTES]).digest() != bytes(view[-_DIGEST_BYTES:]):
        raise CheckpointError("checkpoint digest mismatch: the file is truncated or corrupt")
    (mlen,) = struct.unpack_from("<Q", view, 8)
    if mlen > MANIFEST_BYTES_MAX or 16 + mlen > view.nbytes - _DIGEST_BYTES:
        raise CheckpointError(f"manifest length {mlen} does not fit the file")
    try:
        manifest = orjson.loads(bytes(view[16 : 16 + mlen]))
        return _state_from(manifest, view)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CheckpointError(f"checkpoint manifest does not match format {FORMAT}: {exc!r}") from exc


def content_hash(chunks: Iterable[bytes | memoryview]) -> str:
    """The hex digest a checkpoint's chunks end with (its content address)."""
    *_, last = chunks
    return bytes(last).hex()


def _manifest(state: SyncerState) -> dict:
    return {
        "format": FORMAT,
        "config": state.config.to_dict(),
        "layout": state.layout.describe(),
        "versions": [f.version for f in state.fragments],
        "rounds_opened": [f.rounds_opened for f in state.fragments],
        "global_step": state.global_step,
        "merges": state.merges,
        "next_learner": state.next_learner,
        "timing": [state.timing.step_s, state.timing.quorum_s, state.timing.sync_s],
        "ledger": {"totals": state.ledger.totals, "reported": state.ledger.reported, "open": state.ledger.open},
        "rejections": state.rejections,
        "init_source": state.init_source,
    }


def _state_from(manifest: dict, view: memoryview) -> SyncerState:
    if manifest["format"] != FORMAT:
        raise CheckpointError(f"checkpoint format {manifest['format']} is not {FORMAT}")
    config = from_mapping(manifest["config"])
    layout = layout_from_description(manifest["layout"])
    arrays = {}
    limit = view.nbytes - _DIGEST_BYTES
    for entry in manifest["arrays"]:
        off, n = int(entry["offset"]), int(entry["nbytes"])
        if entry["dtype"] != "float32" or off < 0 or off + n > limit or n != 4 * int(entry["shape"][0]):
            raise CheckpointError(f"array {entry['name']!r} does not fit the file")
        raw = view[off : off + n]
        if hashlib.sha256(raw).hexdigest() != entry["sha256"]:
            raise CheckpointError(f"array {entry['name']!r} fails its content hash")
        arrays[entry["name"]] = np.frombuffer(raw, dtype=np.float32).copy()
    params = [arrays[f"theta/{p}"] for p in range(layout.num_fragments)]
    state = new_state(config, layout, params)
    for p, frag in enumerate(state.fragments):
        frag.momentum = NesterovState(buf=arrays[f"momentum/{p}"])
        frag.version = int(manifest["versions"][p])
        frag.rounds_opened = int(manifest["rounds_opened"][p])
    state.global_step = int(manifest["global_step"])
    state.merges = int(manifest["merges"])
    state.next_learner = int(manifest["next_learner"])
    state.timing = Timing(*manifest["timing"])
    books = manifest["ledger"]
    totals = {f: int(books["totals"][f]) for f in FATES}
    # Windows that were open when the checkpoint was written belong to learners that will come back
    # under new ids: their unpushed tokens were never merged and are booked as lost.
    totals["lost"] += int(books["open"])
    state.ledger = Ledger(totals=totals, closed=int(books["reported"]))
    state.rejections = {str(k): int(v) for k, v in manifest["rejections"].items()}
    state.init_source = str(manifest["init_source"])
    state.decisions = deque()
    for p, frag in enumerate(state.fragments):
        assert frag.theta.shape == (layout.fragments[p].padded_size,)
    return state


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN
