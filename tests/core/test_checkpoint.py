import hashlib
import struct
from pathlib import Path

import numpy as np
import orjson
import pytest
import safetensors
import safetensors.numpy

from ddiloco.core import checkpoint, syncer
from ddiloco.core.checkpoint import CheckpointError
from ddiloco.core.config import SyncerConfig
from ddiloco.core.layout import TensorSpec, build_layout


def some_state(seed=0):
    cfg = SyncerConfig(num_fragments=3, period=3, quorum=2)
    tensors = [TensorSpec(f"blocks/{i}/w", (7, 19 + i)) for i in range(4)] + [
        TensorSpec("embed", (33, 5), embedding=True)
    ]
    layout = build_layout(tensors, 3)
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(f.padded_size).astype(np.float32) for f in layout.fragments]
    state = syncer.new_state(cfg, layout, params)
    for p, frag in enumerate(state.fragments):
        frag.momentum.buf[:] = rng.standard_normal(frag.theta.size)
        frag.version = 5 + p
        frag.rounds_opened = 9 + p
    state.global_step, state.merges, state.next_learner = 41, 17, 6
    state.ledger.report(1, 0, 300, reset=False)
    state.ledger.fate(1, 0, 200, "merged")
    return state


def as_bytes(state) -> bytes:
    return b"".join(bytes(c) for c in checkpoint.to_chunks(state))


def test_round_trip_preserves_state_hash_and_books():
    state = some_state()
    data = as_bytes(state)
    back = checkpoint.restore(data)
    assert syncer.state_hash(back) == syncer.state_hash(state)
    assert back.config == state.config and back.layout == state.layout
    assert back.next_learner == 6
    # the open window (100 unpushed tokens) of a learner that will come back under a new id is lost
    assert back.ledger.totals["merged"] == 200 and back.ledger.totals["lost"] == 100
    back.ledger.check()
    # resume of a resume: the same state, and from then on the same bytes
    again = checkpoint.restore(as_bytes(back))
    assert syncer.state_hash(again) == syncer.state_hash(state)
    assert as_bytes(again) == as_bytes(back)


def test_arrays_are_aligned_and_hashed():
    chunks = checkpoint.to_chunks(some_state())
    assert len(checkpoint.content_hash(chunks)) == 64


@pytest.mark.parametrize("where", [0, 8, 40, -100, -1])
def test_any_flipped_byte_is_detected(where):
    data = bytearray(as_bytes(some_state()))
    data[where] ^= 0x40
    with pytest.raises(CheckpointError):
        checkpoint.restore(data)


def test_truncated_and_foreign_files():
    data = as_bytes(some_state())
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        checkpoint.restore(data[:-10])
    with pytest.raises(CheckpointError, match="not a ddiloco checkpoint"):
        checkpoint.restore(b"PK\x03\x04" + data[4:])
    with pytest.raises(CheckpointError, match="not a ddiloco checkpoint"):
        checkpoint.restore(data[:5])


FORMAT1 = Path(__file__).parent / "golden_checkpoints" / "format1.ddck"  # some_state() in the format before safetensors
# some_state() in format 2 (safetensors, no published copies; broadcast_codec fp32), as the release
# before the delta broadcast wrote it
FORMAT2 = Path(__file__).parent / "golden_checkpoints" / "format2.safetensors"


def test_the_file_is_plain_safetensors_that_standard_tools_open(tmp_path):
    state = some_state()
    path = tmp_path / "c.safetensors"
    path.write_bytes(as_bytes(state))
    with safetensors.safe_open(path, framework="numpy") as f:
        meta = f.metadata()
        assert sorted(f.keys()) == sorted(f"{k}/{p}" for k in ("theta", "momentum", "published") for p in range(3))
        assert np.array_equal(f.get_tensor("momentum/2"), state.fragments[2].momentum.buf)
    assert meta["format"] == checkpoint.CONTAINER and meta["version"] == str(checkpoint.FORMAT)
    manifest = orjson.loads(meta["manifest"])
    assert manifest["merges"] == 17 and manifest["versions"] == [5, 6, 7]


def test_the_run_id_is_in_the_manifest():
    data = b"".join(bytes(c) for c in checkpoint.to_chunks(some_state(), run="0123abcd"))
    assert checkpoint.manifest_of(data)["run"] == "0123abcd"
    assert checkpoint.manifest_of(as_bytes(some_state()))["run"] == ""


def test_a_foreign_safetensors_file_or_another_version_is_refused_by_name():
    foreign = safetensors.numpy.save({"w": np.zeros(4, np.float32)}, {"format": "pt"})
    with pytest.raises(CheckpointError, match="without format 'ddiloco-syncer-checkpoint'"):
        checkpoint.restore(foreign)
    data = as_bytes(some_state()).replace(b'"version":"3"', b'"version":"9"')
    with pytest.raises(CheckpointError, match="format '9'; this version reads formats 3, 2 and 1"):
        checkpoint.restore(data)


def test_a_tampered_array_with_its_header_consistent_fails_its_hash():
    state = some_state()
    chunks = checkpoint.to_chunks(state)
    state.fragments[1].theta[3] += 1.0  # the chunks are views of the state: the bytes change, the manifest not
    with pytest.raises(CheckpointError, match="'theta/1' fails its content hash"):
        checkpoint.restore(b"".join(bytes(c) for c in chunks))


def test_format_1_is_still_read():
    back = checkpoint.restore(FORMAT1.read_bytes())
    assert syncer.state_hash(back) == syncer.state_hash(some_state())
    damaged = bytearray(FORMAT1.read_bytes())
    damaged[3000] ^= 1
    with pytest.raises(CheckpointError, match="digest mismatch"):
        checkpoint.restore(damaged)


def test_empty_syncer_cannot_be_checkpointed():
    with pytest.raises(CheckpointError, match="holds no parameters"):
        checkpoint.to_chunks(syncer.new_state(SyncerConfig()))


def test_format_2_is_still_read_with_published_copies_of_theta():
    back = checkpoint.restore(FORMAT2.read_bytes())
    state = some_state()
    for frag, want in zip(back.fragments, state.fragments):
        assert np.array_equal(frag.theta, want.theta) and np.array_equal(frag.published, want.theta)
        assert frag.published is not frag.theta and frag.published.flags.writeable
    assert syncer.state_hash(back) == syncer.state_hash(state)  # some_state publishes theta as it is


def test_the_published_copy_round_trips_and_is_checked():
    state = some_state()
    rng = np.random.default_rng(7)
    for frag in state.fragments:
        frag.published[:] += rng.standard_normal(frag.published.size).astype(np.float32) * 1e-3
    back = checkpoint.restore(as_bytes(state))
    for frag, want in zip(back.fragments, state.fragments):
        assert frag.published.tobytes() == want.published.tobytes()
    assert syncer.state_hash(back) == syncer.state_hash(state)
    state.fragments[1].published[5] = np.nan
    with pytest.raises(CheckpointError, match="fragment 1's published copy has NaN or Inf values"):
        checkpoint.restore(as_bytes(state))
    state.fragments[1].published = np.zeros(8, np.float32)
    with pytest.raises(CheckpointError, match="fragment 1's published copy is float32 \\(8,\\)"):
        checkpoint.restore(as_bytes(state))


def shard_state(shard, shards=2):
    """some_state()'s model as shard `shard` of `shards`: its own fragments only."""
    whole = some_state()
    cfg = SyncerConfig(num_fragments=3, period=3, quorum=2, shard=shard, shards=shards)
    state = syncer.new_state(cfg, whole.layout, [f.theta.copy() for f in whole.fragments])
    for p in state.owned:
        frag = state.fragments[p]
        frag.momentum.buf[:] = whole.fragments[p].momentum.buf
        frag.version, frag.rounds_opened = whole.fragments[p].version, whole.fragments[p].rounds_opened
    state.global_step, state.merges = 41, 9
    return state


def test_a_shards_checkpoint_holds_its_own_fragments_and_says_which_shard_it_is(tmp_path):
    state = shard_state(1)
    assert state.owned == (1,)
    path = tmp_path / "shard.safetensors"
    path.write_bytes(as_bytes(state))
    with safetensors.safe_open(path, framework="numpy") as f:
        assert sorted(f.keys()) == ["momentum/1", "published/1", "theta/1"]
        manifest = orjson.loads(f.metadata()["manifest"])
    assert (manifest["shard"], manifest["shards"]) == (1, 2)
    back = checkpoint.restore(path.read_bytes())
    assert (back.config.shard, back.config.shards) == (1, 2) and back.owned == (1,)
    assert syncer.state_hash(back) == syncer.state_hash(state)
    assert back.holds_parameters and back.fragments[0].theta is None and back.fragments[2].theta is None
    assert np.array_equal(back.fragments[1].momentum.buf, state.fragments[1].momentum.buf)
    assert as_bytes(checkpoint.restore(as_bytes(back))) == as_bytes(back)


def test_an_unsharded_checkpoint_names_no_shard_and_counts_as_0_of_1():
    manifest = checkpoint.manifest_of(as_bytes(some_state()))
    assert "shard" not in manifest and "shards" not in manifest
    back = checkpoint.restore(FORMAT2.read_bytes())  # written before shards existed
    assert (back.config.shard, back.config.shards) == (0, 1)
    checkpoint.check_resumed_shard(back, 0, 1)


def test_resuming_another_shards_checkpoint_is_refused_naming_both():
    state = checkpoint.restore(as_bytes(shard_state(1)))
    checkpoint.check_resumed_shard(state, 1, 2)
    for shard, shards in ((0, 2), (1, 3), (0, 1)):
        with pytest.raises(
            CheckpointError, match=f"checkpoint is of shard 1 of 2, the configuration is shard {shard} of {shards}"
        ):
            checkpoint.check_resumed_shard(state, shard, shards)


def test_a_manifest_whose_shard_disagrees_with_its_config_is_refused():
    data = as_bytes(shard_state(0))
    manifest = checkpoint.manifest_of(data)
    manifest["shard"] = 1
    raw = orjson.dumps(manifest)
    (hlen,) = struct.unpack_from("<Q", data, 0)
    header = orjson.loads(data[8 : 8 + hlen].rstrip(b" "))
    header["__metadata__"]["manifest"] = raw.decode()
    header["__metadata__"]["sha256"] = hashlib.sha256(raw).hexdigest()
    body = orjson.dumps(header)
    body += b" " * (-len(body) % 8)
    forged = struct.pack("<Q", len(body)) + body + data[8 + hlen :]
    with pytest.raises(CheckpointError, match="manifest says shard 1 of 2, its config shard 0 of 2"):
        checkpoint.restore(forged)
