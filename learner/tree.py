"""A JAX parameter pytree <-> the syncer's flat float32 fragments.

Works with any pytree (plain dicts and lists, flax, equinox): leaves are named by their key path
("blocks/0/attn/w"), and the same names, shapes, dtypes and embedding flags give the syncer's layout,
so both sides compute the same layout digest. Host copies are gathered per fragment (a leaf sharded
over several devices is gathered to the host), and values that come back are put onto each leaf's
original sharding and dtype.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey, tree_flatten_with_path, tree_unflatten

from ddiloco.core.layout import Layout, LayoutError, TensorSpec

__all__ = [
    "LeafPlace",
    "TreeFragments",
    "default_is_embedding",
    "leaf_path",
    "put_all_like",
    "tensor_specs",
]

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def default_is_embedding(path: str) -> bool:
    """Token embeddings and untied output heads are mean-merged (docs/algorithm.md, "Fragments and the schedule")."""
    parts = path.lower().split("/")
    return any("embed" in part or part in ("wte", "lm_head") for part in parts)


def leaf_path(keys: tuple) -> str:
    names = []
    for key in keys:
        if isinstance(key, DictKey):
            names.append(str(key.key))
        elif isinstance(key, SequenceKey):
            names.append(str(key.idx))
        elif isinstance(key, GetAttrKey):
            names.append(key.name)
        elif isinstance(key, FlattenedIndexKey):
            names.append(str(key.key))
        else:
            names.append(str(key))
    return "/".join(names) or "root"


def tensor_specs(params: Any, is_embedding: Callable[[str], bool] = default_is_embedding) -> tuple[TensorSpec, ...]:
    """The layout input for `params`: one TensorSpec per leaf."""
    specs = []
    for keys, leaf in tree_flatten_with_path(params)[0]:
        path = leaf_path(keys)
        dtype = str(leaf.dtype)
        if dtype not in _DTYPES:
            raise LayoutError(f"leaf {path!r} has dtype {dtype}; only float32, bfloat16 and float16 parameters sync")
        specs.append(TensorSpec(path, tuple(leaf.shape), dtype, is_embedding(path)))
    return tuple(specs)


class LeafPlace(NamedTuple):
    """Where and how a leaf lives, without the leaf itself (holding none of its memory): what placing
    values like it takes (`put_all_like` reads `sharding` and `committed`), and what a value placed
    for it is compared by (`TreeFragments.fits`)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Any  # None: a host array (numpy), not a device array
    committed: bool


def _place_of(leaf: Any) -> LeafPlace:
    """The `LeafPlace` of a leaf (a device array, or a host one)."""
    sharding = getattr(leaf, "sharding", None)
    return LeafPlace(tuple(leaf.shape), np.dtype(leaf.dtype), sharding, bool(getattr(leaf, "committed", True)))


@dataclass(frozen=True)
class _Slot:
    leaf: int  # index among the flattened leaves
    fragment: int
    offset: int
    size: int


class TreeFragments:
    """The mapping between one pytree structure and a layout; checked once, used every step."""

    def __init__(self, params: Any, layout: Layout, is_embedding: Callable[[str], bool] = default_is_embedding):
        leaves_with_paths, self.treedef = tree_flatten_with_path(params)
        self.layout = layout
        paths = [leaf_path(k) for k, _ in leaves_with_paths]
        mine = {s.path: s for s in tensor_specs(params, is_embedding)}
        theirs = {t.path: t for t in layout.tensors}
        if mine != theirs:
            missing = sorted(set(theirs) - set(mine))[:3]
            extra = sorted(set(mine) - set(theirs))[:3]
            changed = sorted(p for p in set(mine) & set(theirs) if mine[p] != theirs[p])[:3]
            raise LayoutError(
                f"the parameters do not match the syncer's layout: missing {missing}, unexpected {extra}, "
                f"different shape/dtype/embedding {changed}"
            )
        # The way to one leaf, walked at every hook call (`probe`): flattening the whole tree costs
        # tens of microseconds on a model of hundreds of leaves.
        self._probe_path = _getters(leaves_with_paths[0][0]) if leaves_with_paths else None
        self._probe_type: type | None = None  # the probe's type last seen: a device array's (`probe`)
        index = {p: i for i, p in enumerate(paths)}
        self.slots: list[list[_Slot]] = []
        for frag in layout.fragments:
            self.slots.append([_Slot(index[s.tensor.path], frag.index, s.offset, s.tensor.size) for s in frag.segments])

    def gather(self, params: Any, p: int) -> np.ndarray:
        """float32[padded] host copy of fragment p of `params`."""
        return self.finish_gather(p, self.leaves(params, p))

    def probe(self, params: Any) -> jax.Array | None:
        """The first leaf of `params` where it is a device array, found by its key path without
        flattening the tree (learner.lead asks it whether its step is computed); None for a host
        leaf, or a pytree whose keys cannot be followed one by one."""
        if self._probe_path is None:
            return None
        node = params
        try:
            for get in self._probe_path:
                node = get(node)
        except (KeyError, IndexError, AttributeError, TypeError):
            return None
        # Called by most of the hook's calls, each after a step that took its code and data out of
        # the caches: the type seen last spares the abstract base class's check (measured at 20 ms
        # steps: the walk by key kinds and that check took 25 of a quiet call's 43 us).
        if type(node) is self._probe_type:
            return node
        if not isinstance(node, jax.Array):
            return None
        self._probe_type = type(node)
        return node

    def leaves(self, params: Any, p: int) -> list[Any]:
        """Fragment p's leaves of `params`, as they are (device arrays stay on the device)."""
        leaves = self.treedef.flatten_up_to(params)
        return [leaves[slot.leaf] for slot in self.slots[p]]

    def start_gather(self, params: Any, p: int) -> list[Any]:
        """Fragment p's leaves of `params`, their device-to-host copies started and not waited for:
        `finish_gather` them a step or more later, when the copies have landed meanwhile. Nothing
        waits for the device here (with asynchronous dispatch the leaves may not be computed yet)."""
        mine = self.leaves(params, p)
        for leaf in mine:
            start = getattr(leaf, "copy_to_host_async", None)
            if start is not None and not _in_host_memory(leaf.sharding):
                start()
        return mine

    def finish_gather(self, p: int, leaves: list[Any]) -> np.ndarray:
        """float32[padded] host copy of fragment p from its `leaves` (`leaves` or `start_gather`)."""
        frag = self.layout.fragments[p]
        # The tensors lie end to end from 0 (core.layout): only the padding after them needs zeros,
        # not the whole fragment (a 10 MB fragment's copy took 1.6 ms zeroed first, 1.0 ms without).
        out = np.empty(frag.padded_size, dtype=np.float32)
        out[frag.size :] = 0.0
        # one transfer call for the fragment's leaves (measured: 74 against 104 us for five leaves)
        hosts = jax.device_get(leaves)
        for slot, host in zip(self.slots[p], hosts):
            out[slot.offset : slot.offset + slot.size] = np.asarray(host, dtype=np.float32).reshape(-1)
        return out

    def scatter(self, params: Any, p: int, values: np.ndarray, alpha: float = 0.0) -> Any:
        """`params` with fragment p replaced by `values` (float32[padded]), or mixed as
        alpha * theta + (1 - alpha) * values; each leaf keeps its dtype and sharding."""
        leaves, olds, slices = self._slices(params, p, values)
        news = []
        for old, new in zip(olds, slices):
            if alpha:
                new = alpha * np.asarray(jax.device_get(old), dtype=np.float32) + (1.0 - alpha) * new
            news.append(np.asarray(new, dtype=old.dtype))
        for slot, leaf in zip(self.slots[p], put_all_like(news, olds)):
            leaves[slot.leaf] = leaf
        return tree_unflatten(self.treedef, leaves)

    def add(self, params: Any, p: int, values: np.ndarray) -> Any:
        """`params` with `values` (float32[padded]) added to fragment p: each leaf's slice moved to
        where the leaf is (`place`) in the leaf's dtype and added there, so a device leaf is added on
        its devices without waiting for them, and keeps its dtype and sharding."""
        return self.add_placed(params, p, self.place(p, self.placement(params, p), values))

    def placement(self, params: Any, p: int) -> tuple[LeafPlace, ...]:
        """Where each of fragment p's leaves of `params` lives (`place` puts values there)."""
        return tuple(_place_of(leaf) for leaf in self.leaves(params, p))

    def place(self, p: int, placement: tuple[LeafPlace, ...], values: np.ndarray) -> list[Any]:
        """`values` (float32[padded]) cut into fragment p's leaves, each in its leaf's shape and dtype
        and put where `placement` says (`put_all_like`). Reads no parameters: callable on any thread,
        ahead of the step that adds them (`add_placed`)."""
        slices = [
            np.asarray(values[s.offset : s.offset + s.size].reshape(at.shape), dtype=at.dtype)
            for s, at in zip(self.slots[p], placement, strict=True)
        ]
        return put_all_like(slices, list(placement))

    def fits(self, params: Any, p: int, placed: list[Any]) -> bool:
        """Whether `placed` (from `place`) lies where fragment p's leaves of `params` are now, in
        their shapes and dtypes: else adding it would move a leaf or change its type."""
        return len(placed) == len(self.slots[p]) and all(
            _place_of(new) == _place_of(old) for new, old in zip(placed, self.leaves(params, p))
        )

    def warm_add(self, placement: tuple[LeafPlace, ...]) -> None:
        """Compile the device add of a fragment whose leaves live as `placement` says (`add_placed`),
        by running it once on zeros placed so: on any thread, ahead of the fragment's first version
        added. Else that compile falls on the training thread, in the step of the first apply
        (measured: 40-60 ms a fragment for the reference model on this project's 2-core host, four
        times in a run)."""
        zeros = put_all_like([np.zeros(at.shape, at.dtype) for at in placement], list(placement))
        if _one_program(zeros, zeros):
            jax.block_until_ready(_added(zeros, zeros))

    def add_placed(self, params: Any, p: int, placed: list[Any]) -> Any:
        """`params` with `placed` (from `place`, `fits`) added to fragment p's leaves, where they are."""
        leaves = list(self.treedef.flatten_up_to(params))
        olds = [leaves[slot.leaf] for slot in self.slots[p]]
        if _one_program(olds, placed):
            news = _added(olds, placed)
        else:
            news = [old + add for old, add in zip(olds, placed, strict=True)]
        for slot, new in zip(self.slots[p], news):
            leaves[slot.leaf] = new
        return tree_unflatten(self.treedef, leaves)

    def _slices(self, params: Any, p: int, values: np.ndarray) -> tuple[list[Any], list[Any], list[np.ndarray]]:
        """(every leaf of `params`, fragment p's leaves, each one's slice of `values` in its shape)."""
        leaves = list(self.treedef.flatten_up_to(params))
        olds = [leaves[slot.leaf] for slot in self.slots[p]]
        slices = [values[s.offset : s.offset + s.size].reshape(old.shape) for s, old in zip(self.slots[p], olds)]
        return leaves, olds, slices


# The adds of one fragment as one dispatched program: on a loop's hot path each eager `+` costs
# the training thread tens of microseconds of dispatch (measured: 4 leaves, 254 us one by one).
_added = jax.jit(lambda olds, adds: [old + add for old, add in zip(olds, adds)])


def _one_program(olds: list[Any], adds: list[Any]) -> bool:
    """Whether `_added` can add these: device arrays all on one set of devices (one program runs
    on one set; leaves spread over several, as in a pipeline, are added one by one, where they are)."""
    if len(olds) != len(adds) or not all(isinstance(x, jax.Array) for x in (*olds, *adds)):
        return False
    return len({frozenset(x.sharding.device_set) for x in (*olds, *adds)}) == 1


@functools.lru_cache(maxsize=64)
def _in_host_memory(sharding: Any) -> bool:
    """Whether arrays of this sharding lie in the host's memory already (CPU devices): their host
    copy is the buffer itself (`np.asarray` makes none), and starting one costs the training thread
    50-100 us a leaf for nothing (measured in `ddiloco bench learner` at 20 ms steps)."""
    return all(d.platform == "cpu" for d in sharding.device_set)


def _getters(path: tuple[Any, ...]) -> tuple[Callable[[Any], Any], ...] | None:
    """A key path as the item and attribute getters that follow it (`TreeFragments.probe`); None
    where a key is of another kind (a custom node's: the probe then finds no leaf)."""
    getters: list[Callable[[Any], Any]] = []
    for key in path:
        if isinstance(key, DictKey):
            getters.append(operator.itemgetter(key.key))
        elif isinstance(key, SequenceKey):
            getters.append(operator.itemgetter(key.idx))
        elif isinstance(key, GetAttrKey):
            getters.append(operator.attrgetter(key.name))
        else:
            return None
    return tuple(getters)


def put_all_like(arrays: list[np.ndarray], olds: list[Any]) -> list[Any]:
    """Each of `arrays` placed as its `olds` leaf is: on its sharding when the leaf is committed to
    devices (a sharded leaf), uncommitted like a freshly initialised one otherwise, and left on the
    host where the leaf is no device array. Committed-ness is part of jit's cache key: putting an
    uncommitted leaf back committed recompiles the training step (measured: a 23 s stall per learner
    on the demo's 2 shared cores, when a learner's first fragment arrived). One transfer call per
    kind of placement (measured: 294 against 428 us for five of the demo model's leaves)."""
    out: list[Any] = list(arrays)
    groups: dict[bool, list[int]] = {True: [], False: []}  # committed to devices, or not
    for i, old in enumerate(olds):
        if getattr(old, "sharding", None) is not None:
            groups[bool(getattr(old, "committed", True))].append(i)
    for committed, idx in groups.items():
        if idx:
            where = [olds[i].sharding for i in idx] if committed else None
            for i, leaf in zip(idx, jax.device_put([arrays[i] for i in idx], where)):
                out[i] = leaf
    return out
