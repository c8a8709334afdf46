"""The syncer's checkpoint format: a safetensors file with a JSON manifest, content hashed, no pickle.

A checkpoint holds what a resumed syncer needs to continue with no lost merge: the config, the
layout, every fragment's parameters, momentum, version and round counter, the global step, the
counters and the token ledger's books. A shard of a sharded syncer (core.shards) holds the arrays of
its own fragments only, and its manifest says which shard of how many it is ("shard", "shards";
absent: 0 of 1, the whole syncer); a shard resumes its own checkpoints only (`check_resumed_shard`). Learners are not in it: they reconnect by themselves (their
open token windows are booked as lost, they were never merged).

The container (format 3) is a plain safetensors file (docs/checkpoints.md says why), so any tool
that reads safetensors opens it:

    tensors        "theta/<p>", "momentum/<p>" and "published/<p>" (the copy the learners
                   reconstruct from the delta broadcast, core.publish) for every fragment p the
                   syncer owns (all of them unless it is a shard), F32, one dimension
    __metadata__   "format": "ddiloco-syncer-checkpoint", "version": "3",
                   "manifest": the manifest, JSON: the fields of `_manifest`, the run id, and
                               "arrays": {name: sha256 of its bytes},
                   "sha256":   sha256 of the manifest's bytes (the checkpoint's content address)

The manifest names the sha256 of every array and the manifest's own sha256 is in the metadata, so
one digest covers every byte that matters; the safetensors reader checks the rest of the header
(offsets that tile the file exactly: a truncated file is refused). The arrays are written straight
from the state's buffers (`to_chunks` copies nothing) and read back through the safetensors library.

Formats 2 (the same container without "published/<p>") and 1 (`DDCKPT01`: a manifest, raw
64-byte-aligned arrays and a trailing sha256 of the whole file) are still read, so checkpoints and
tapes written before keep working, their published copies taken as copies of theta; they are no
longer written.

Writing the file atomically (temp file, fsync, rename) is the shell's job (net.files); this module
only turns a state into bytes and bytes back into a state, refusing anything that does not check out.
"""

from __future__ import annotations

import hashlib
import struct
from collections import deque
from collections.abc import Iterable

import numpy as np
import orjson
import safetensors
import safetensors.numpy

from ddiloco.core.config import from_mapping
from ddiloco.core.grace import Timing
from ddiloco.core.layout import layout_from_description
from ddiloco.core.ledger import FATES, Ledger
from ddiloco.core.outer import NesterovState
from ddiloco.core.syncer import SyncerState, new_state
from ddiloco.errors import UserError

__all__ = [
    "CONTAINER",
    "FORMAT",
    "CheckpointError",
    "check_resumed_shard",
    "content_hash",
    "manifest_of",
    "restore",
    "to_chunks",
]

CONTAINER = "ddiloco-syncer-checkpoint"  # the metadata's "format": what kind of safetensors file this is
FORMAT = 3
FORMATS_READ = (3, 2)  # safetensors containers; format 1 has its own magic
MAGIC_V1 = b"DDCKPT01"
_DIGEST_BYTES = 32
_HEADER_ALIGN = 8  # safetensors pads its JSON header with spaces to a multiple of 8
MANIFEST_BYTES_MAX = 64 << 20
RUN_CHARS_MAX = 64


class CheckpointError(UserError, ValueError):
    """A checkpoint that is corrupt, truncated or of another format; the message says which."""


def to_chunks(state: SyncerState, run: str = "") -> list[bytes | memoryview]:
    """The checkpoint as a list of byte chunks, the arrays not copied. `run` names the run that
    wrote it (net.store; empty when it belongs to none, as a tape's initial state)."""
    if not state.holds_parameters:
        raise CheckpointError("the syncer holds no parameters yet: nothing to checkpoint")
    if len(run) > RUN_CHARS_MAX:
        raise CheckpointError(f"run id of {len(run)} characters is above the limit of {RUN_CHARS_MAX}")
    arrays = []
    for p in state.owned:
        frag = state.fragments[p]
        arrays += [(f"theta/{p}", frag.theta), (f"momentum/{p}", frag.momentum.buf), (f"published/{p}", frag.published)]
    hashes = {name: hashlib.sha256(memoryview(arr)).hexdigest() for name, arr in arrays}
    manifest = orjson.dumps({**_manifest(state), "run": run, "arrays": hashes})
    header: dict = {
        "__metadata__": {
            "format": CONTAINER,
            "version": str(FORMAT),
            "manifest": manifest.decode(),
            "sha256": hashlib.sha256(manifest).hexdigest(),
        }
    }
    offset = 0
    for name, arr in arrays:
        assert arr.dtype == np.float32 and arr.ndim == 1, f"{name} is {arr.dtype} of {arr.ndim} dimensions"
        header[name] = {"dtype": "F32", "shape": [int(arr.size)], "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    body = orjson.dumps(header)
    body += b" " * (-len(body) % _HEADER_ALIGN)
    return [struct.pack("<Q", len(body)) + body, *(memoryview(arr).cast("B") for _, arr in arrays)]


def restore(buf: bytes | bytearray | memoryview) -> SyncerState:
    """A syncer state from checkpoint bytes (format 3, 2 or 1); raises CheckpointError on any mismatch."""
    view = memoryview(buf).cast("B")
    if bytes(view[:8]) == MAGIC_V1:
        return _restore_v1(view)
    manifest = manifest_of(view)
    try:
        tensors = safetensors.numpy.load(bytes(view))
    except safetensors.SafetensorError as exc:
        raise CheckpointError(f"the safetensors container is truncated or corrupt: {exc}") from exc
    arrays = {}
    for name, sha in manifest["arrays"].items():
        arr = tensors.get(name)
        if arr is None or arr.dtype != np.float32 or arr.ndim != 1:
            raise CheckpointError(f"array {name!r} is missing or not a one-dimensional float32 tensor")
        if hashlib.sha256(memoryview(arr)).hexdigest() != sha:
            raise CheckpointError(f"array {name!r} fails its content hash")
        arrays[name] = arr
    return _checked_state(manifest, arrays)


def manifest_of(buf: bytes | bytearray | memoryview) -> dict:
    """The manifest of a format-3 or -2 checkpoint (run id, versions, counters: no arrays), its hash checked."""
    view = memoryview(buf).cast("B")
    meta = _metadata(view)
    raw = meta["manifest"].encode()
    if hashlib.sha256(raw).hexdigest() != meta["sha256"]:
        raise CheckpointError("checkpoint manifest fails its content hash: the file is corrupt")
    try:
        manifest = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise CheckpointError(f"checkpoint manifest is not JSON: {exc}") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("arrays"), dict):
        raise CheckpointError("checkpoint manifest is not an object with its arrays")
    return manifest


def content_hash(chunks: Iterable[bytes | memoryview]) -> str:
    """The checkpoint's content address (hex sha256 of its manifest, which names every array's hash)."""
    first = next(iter(chunks))
    return _metadata(memoryview(first).cast("B"))["sha256"]


def _metadata(view: memoryview) -> dict:
    """The safetensors header's `__metadata__` of a ddiloco checkpoint, or CheckpointError."""
    if view.nbytes < 8:
        raise CheckpointError("not a ddiloco checkpoint: shorter than a safetensors header")
    (hlen,) = struct.unpack_from("<Q", view, 0)
    if hlen > MANIFEST_BYTES_MAX or 8 + hlen > view.nbytes:
        raise CheckpointError(f"not a ddiloco checkpoint, or a truncated one: header of {hlen} bytes does not fit")
    try:
        header = orjson.loads(bytes(view[8 : 8 + hlen]).rstrip(b" "))
    except orjson.JSONDecodeError as exc:
        raise CheckpointError(f"not a ddiloco checkpoint: the header is not JSON ({exc})") from exc
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != CONTAINER:
        raise CheckpointError(
            f"not a ddiloco checkpoint: a safetensors file without format {CONTAINER!r} in its metadata"
        )
    if meta.get("version") not in {str(f) for f in FORMATS_READ}:
        raise CheckpointError(f"checkpoint format {meta.get('version')!r}; this version reads formats 3, 2 and 1")
    if not isinstance(meta.get("manifest"), str) or not isinstance(meta.get("sha256"), str):
        raise CheckpointError("checkpoint metadata lacks its manifest or its sha256")
    return meta


def check_resumed_shard(state: SyncerState, shard: int, shards: int) -> None:
    """Refuse to resume a checkpoint of another shard, or of another split: its fragments are not
    the ones shard `shard` of `shards` owns, and the learners would route theirs elsewhere."""
    ours = (state.config.shard, state.config.shards)
    if ours != (shard, shards):
        raise CheckpointError(
            f"the checkpoint is of shard {ours[0]} of {ours[1]}, the configuration is shard {shard} of {shards}: "
            "a shard resumes only its own checkpoints (give the shard and shards it was written with, "
            "or resume the directory of the right shard)"
        )


def _manifest(state: SyncerState) -> dict:
    # A shard says so at the top of its manifest; an unsharded one writes what it always wrote.
    sharded = {"shard": state.config.shard, "shards": state.config.shards} if state.config.shards > 1 else {}
    return {
        **sharded,
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


def _restore_v1(view: memoryview) -> SyncerState:
    """Format 1: magic, manifest length, manifest, 64-byte-aligned raw arrays, sha256 of all before it."""
    if view.nbytes < 16 + _DIGEST_BYTES:
        raise CheckpointError("not a ddiloco checkpoint (format 1, too short)")
    if hashlib.sha256(view[:-_DIGEST_BYTES]).digest() != bytes(view[-_DIGEST_BYTES:]):
        raise CheckpointError("checkpoint digest mismatch: the file is truncated or corrupt")
    (mlen,) = struct.unpack_from("<Q", view, 8)
    if mlen > MANIFEST_BYTES_MAX or 16 + mlen > view.nbytes - _DIGEST_BYTES:
        raise CheckpointError(f"manifest length {mlen} does not fit the file")
    try:
        manifest = orjson.loads(bytes(view[16 : 16 + mlen]))
        if manifest["format"] != 1:
            raise CheckpointError(f"checkpoint format {manifest['format']} under the magic of format 1")
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
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CheckpointError(f"checkpoint manifest does not match format 1: {exc!r}") from exc
    return _checked_state(manifest, arrays)


def _checked_state(manifest: dict, arrays: dict[str, np.ndarray]) -> SyncerState:
    try:
        return _state_from(manifest, arrays)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint manifest does not match its format: {exc!r}") from exc


def _state_from(manifest: dict, arrays: dict[str, np.ndarray]) -> SyncerState:
    config = from_mapping(manifest["config"])
    layout = layout_from_description(manifest["layout"])
    # The parameters are checked here, with numpy, rather than by new_state's kernel: a resumed syncer
    # reads its checkpoint before it listens, and the kernels' first call costs a second (numba).
    said = (int(manifest.get("shard", 0)), int(manifest.get("shards", 1)))
    if said != (config.shard, config.shards):
        raise CheckpointError(
            f"the manifest says shard {said[0]} of {said[1]}, its config shard {config.shard} of {config.shards}"
        )
    state = new_state(config, layout)
    for p in state.owned:  # a shard's checkpoint holds its own fragments' arrays only
        frag = state.fragments[p]
        theta = arrays[f"theta/{p}"]
        if theta.dtype != np.float32 or theta.shape != (layout.fragments[p].padded_size,):
            raise CheckpointError(f"fragment {p}'s arrays do not have the size its layout gives it")
        if not _all_finite(theta):
            raise CheckpointError(f"fragment {p} has NaN or Inf values")
        if not theta.flags.writeable or not theta.flags.c_contiguous:
            theta = np.ascontiguousarray(theta).copy()  # the syncer owns and updates its fragments in place
        frag.theta = theta
        frag.momentum = NesterovState(buf=arrays[f"momentum/{p}"])
        frag.published = _published(arrays, p, theta) if int(manifest["format"]) >= 3 else theta.copy()
        frag.version = int(manifest["versions"][p])
        frag.rounds_opened = int(manifest["rounds_opened"][p])
    state.global_step = int(manifest["global_step"])
    state.merges = int(manifest["merges"])
    state.next_learner = int(manifest["next_learner"])
    state.timing = Timing(*manifest["timing"])
    books = manifest["ledger"]
    totals = {f: int(books["totals"].get(f, 0)) for f in FATES}  # merged_late: since protocol 2
    # Windows that were open when the checkpoint was written belong to learners that will come back
    # under new ids: their unpushed tokens were never merged and are booked as lost.
    totals["lost"] += int(books["open"])
    state.ledger = Ledger(totals=totals, closed=int(books["reported"]))
    state.rejections = {str(k): int(v) for k, v in manifest["rejections"].items()}
    state.init_source = str(manifest["init_source"])
    state.decisions = deque()
    for p in state.owned:
        frag = state.fragments[p]
        if frag.theta.shape != (layout.fragments[p].padded_size,) or frag.momentum.buf.shape != frag.theta.shape:
            raise CheckpointError(f"fragment {p}'s arrays do not have the size its layout gives it")
    return state


def _published(arrays: dict[str, np.ndarray], p: int, theta: np.ndarray) -> np.ndarray:
    """Fragment p's published copy of a format-3 checkpoint, checked as theta is."""
    published = arrays.get(f"published/{p}")
    if published is None:
        raise CheckpointError(f"fragment {p} has no published copy (published/{p}), which format 3 needs")
    if published.dtype != np.float32 or published.shape != theta.shape:
        raise CheckpointError(
            f"fragment {p}'s published copy is {published.dtype} {published.shape}, needs float32 {theta.shape}"
        )
    if not _all_finite(published):
        raise CheckpointError(f"fragment {p}'s published copy has NaN or Inf values")
    if not published.flags.writeable or not published.flags.c_contiguous:
        published = np.ascontiguousarray(published).copy()  # updated in place by the next publish
    return published


_FINITE_CHUNK_ELEMENTS = 1 << 20  # numpy's isfinite makes a bool per element: a chunk at a time


def _all_finite(values: np.ndarray) -> bool:
    return all(
        bool(np.isfinite(values[i : i + _FINITE_CHUNK_ELEMENTS]).all())
        for i in range(0, values.size, _FINITE_CHUNK_ELEMENTS)
    )
