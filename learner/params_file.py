"""The trained model as a file: the syncer's global parameters under their pytree paths, and back.

`export` reads a syncer checkpoint (the newest valid one of a directory, or a given file) through
`net.store` and `core.checkpoint` and writes every tensor of the layout under its path
("blocks/0/attn/w", the names `learner.tree` gives a pytree's leaves), in its shape, as float32: the
syncer's own copy, also of tensors a learner trains in bfloat16. Three formats, each readable by its
own library without ddiloco:

    safetensors  one file, keys are the paths (`safetensors.numpy.load_file`)
    npz          one file, keys are the paths (`numpy.load`, no pickle)
    orbax        a directory, the paths split on "/" into nested dicts (`orbax.checkpoint`)

`load_params(path, like=params)` puts such a file into a user's pytree: the same leaf paths, shapes
and dtypes as `like` (a float32 value may go into a bfloat16 or float16 leaf, as the syncer's copy
of one), each leaf placed where the leaf of `like` is; anything else is refused naming the leaves.
jax and orbax are imported only where needed, so a syncer host without them exports the other two.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.core import checkpoint
from ddiloco.core.syncer import SyncerState
from ddiloco.errors import UserError
from ddiloco.net import files, store

FORMATS = ("safetensors", "npz", "orbax")
# A value of float32 may go into leaves of these dtypes (the syncer keeps float32 copies of them).
_NARROWER = {"bfloat16", "float16"}
_LEAVES_NAMED_MAX = 5  # how many mismatching leaves an error lists


class ParamsFileError(UserError, ValueError):
    """A parameter file that cannot be written, read or put into the given pytree; says which leaves."""


@dataclass(frozen=True)
class Exported:
    path: Path
    checkpoint: Path
    tensors: int
    values: int
    merges: int
    global_step: int


def global_params(state: SyncerState) -> dict[str, np.ndarray]:
    """path -> float32 array in the tensor's shape, for every tensor of the layout (copies)."""
    out = {}
    for spec, frag in zip(state.layout.fragments, state.fragments):
        for seg in spec.segments:
            out[seg.tensor.path] = frag.theta[seg.offset : seg.stop].reshape(seg.tensor.shape).copy()
    return out


def read_checkpoint(source: str | Path) -> tuple[SyncerState, Path]:
    """The state in a checkpoint file, or in the newest valid checkpoint of a directory."""
    source = Path(source)
    if source.is_dir():
        try:
            return store.newest_valid(source)
        except store.StoreError as exc:
            raise ParamsFileError(str(exc)) from exc
    try:
        return checkpoint.restore(source.read_bytes()), source
    except OSError as exc:
        raise ParamsFileError(f"cannot read checkpoint {source}: {exc.strerror or exc}") from exc
    except checkpoint.CheckpointError as exc:
        raise ParamsFileError(f"{source}: {exc}") from exc


def export(source: str | Path, out: str | Path, fmt: str) -> Exported:
    """Write the global parameters of the checkpoint at `source` (see `read_checkpoint`) to `out`."""
    state, path = read_checkpoint(source)
    tensors = global_params(state)
    metadata = {
        "ddiloco.checkpoint": path.name,
        "ddiloco.merges": str(state.merges),
        "ddiloco.global_step": str(state.global_step),
        "ddiloco.layout": state.layout.digest,
    }
    write_params(tensors, out, fmt, metadata)
    return Exported(
        Path(out), path, len(tensors), sum(a.size for a in tensors.values()), state.merges, state.global_step
    )


def write_params(
    tensors: Mapping[str, np.ndarray], out: str | Path, fmt: str, metadata: Mapping[str, str] | None = None
) -> None:
    """`tensors` (path -> array) to a new file or directory `out`; `metadata` goes where the format
    keeps some (safetensors' header). An existing `out` is refused: nothing is overwritten."""
    out = Path(out)
    if fmt not in FORMATS:
        raise ParamsFileError(f"format {fmt!r} is not one of {list(FORMATS)}")
    if out.exists():
        raise ParamsFileError(f"{out} already exists: give a new path")
    if fmt == "orbax":
        _write_orbax(tensors, out)
        return
    # A file appears under its name complete or not at all, and stays after a power cut: the writer
    # libraries stream to the daemon's temporary name (net.files), then fsync, rename, fsync the
    # directory, as net.files.write_atomic does for bytes already in memory.
    tmp = files.temporary_name(out)
    try:
        if fmt == "safetensors":
            safetensors_numpy = _optional("safetensors.numpy", "safetensors")
            safetensors_numpy.save_file(dict(tensors), tmp, metadata=dict(metadata or {}))
        else:
            with open(tmp, "wb") as fh:
                np.savez(fh, **tensors)
        files.fsync_file(tmp)
        os.replace(tmp, out)
        files.fsync_directory(out.parent)
    except OSError as exc:
        raise ParamsFileError(f"cannot write {out}: {exc.strerror or exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)


def read_params(path: str | Path) -> dict[str, np.ndarray]:
    """path -> array from a file written by `write_params` (or any file of these formats whose keys
    are the paths); the format is told by what `path` is: a directory is orbax."""
    path = Path(path)
    if path.is_dir():
        return _read_orbax(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError as exc:
        raise ParamsFileError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if head[:4] == b"PK\x03\x04":  # a zip archive: npz
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    safetensors_numpy = _optional("safetensors.numpy", "safetensors")
    try:
        return dict(safetensors_numpy.load_file(path))
    except Exception as exc:  # the library raises its own error types for a file that is not its own
        raise ParamsFileError(f"{path} is neither an npz, a safetensors file nor an orbax directory: {exc}") from exc


def load_params(path: str | Path, like: Any) -> Any:
    """The parameters in `path` as a pytree of the structure, shapes and dtypes of `like`."""
    from jax.tree_util import tree_flatten_with_path, tree_unflatten

    from ddiloco.learner.tree import leaf_path, put_all_like

    stored = read_params(path)
    flat, treedef = tree_flatten_with_path(like)
    paths = [leaf_path(keys) for keys, _ in flat]
    missing = sorted(set(paths) - set(stored))
    unexpected = sorted(set(stored) - set(paths))
    if missing or unexpected:
        raise ParamsFileError(
            f"{path} does not hold the leaves of this pytree: missing {_few(missing)}, unexpected {_few(unexpected)}"
        )
    arrays, problems = [], []
    for name, (_, leaf) in zip(paths, flat):
        value, want = stored[name], np.dtype(leaf.dtype)
        if tuple(value.shape) != tuple(leaf.shape):
            problems.append(f"{name}: shape {tuple(value.shape)} in the file, {tuple(leaf.shape)} in the pytree")
        elif value.dtype != want and not (value.dtype == np.float32 and want.name in _NARROWER):
            problems.append(f"{name}: dtype {value.dtype} in the file, {want} in the pytree")
        else:
            arrays.append(np.asarray(value, dtype=want))
    if problems:
        raise ParamsFileError(
            f"{path} does not fit this pytree: {'; '.join(problems[:_LEAVES_NAMED_MAX])}"
            + (f" (and {len(problems) - _LEAVES_NAMED_MAX} more)" if len(problems) > _LEAVES_NAMED_MAX else "")
        )
    return tree_unflatten(treedef, put_all_like(arrays, [leaf for _, leaf in flat]))


def _write_orbax(tensors: Mapping[str, np.ndarray], out: Path) -> None:
    ocp = _optional("orbax.checkpoint", "orbax-checkpoint")
    nested: dict[str, Any] = {}
    for name, value in tensors.items():
        *tables, leaf = name.split("/")
        node = nested
        for table in tables:
            node = node.setdefault(table, {})
        node[leaf] = value
    with ocp.StandardCheckpointer() as checkpointer:  # orbax wants an absolute path
        checkpointer.save(out.resolve(), nested)
        checkpointer.wait_until_finished()


def _read_orbax(path: Path) -> dict[str, np.ndarray]:
    ocp = _optional("orbax.checkpoint", "orbax-checkpoint")
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            nested = checkpointer.restore(path.resolve())
        except (FileNotFoundError, ValueError) as exc:
            raise ParamsFileError(f"{path} is not an orbax checkpoint: {exc}") from exc
    out: dict[str, np.ndarray] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping):
            for key, child in node.items():
                walk(child, f"{prefix}/{key}" if prefix else str(key))
        else:
            out[prefix] = np.asarray(node)

    walk(nested, "")
    return out


def _optional(module: str, package: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ParamsFileError(f"this format needs the {package} package: `pip install {package}`") from exc


def _few(names: list[str]) -> str:
    more = f" and {len(names) - _LEAVES_NAMED_MAX} more" if len(names) > _LEAVES_NAMED_MAX else ""
    return f"{names[:_LEAVES_NAMED_MAX]}{more}"
