"""The fragment layout: which tensors of the model make up each of the P fragments.

docs/algorithm.md, "Fragments and the schedule". A fragment is stored flat, in float32: its tensors
concatenated in path order, then zero padding up to a multiple of the codec block so that every block
codec sees whole blocks. The layout is a pure function of the tensor list, the strategy, P and the
block; its digest is what the syncer and every learner compare at hello time.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import orjson

from ddiloco.errors import UserError

# Limits on what a layout may describe; a hello carrying more is refused before anything is allocated.
TENSORS_MAX = 1_000_000
FRAGMENTS_MAX = 4096
PATH_CHARS_MAX = 512
# A path is printable ASCII: it is compared, sorted, split at '/' and '.', and numbered components
# ('blocks/10') are read as integers, which only ASCII digits are (str.isdigit also accepts '²').
PATH_RE = re.compile(r"[\x20-\x7e]+")
FRAGMENT_ELEMENTS_MAX = 2**31 - 1  # int32 indexing inside kernels stays safe below this
DIMS_MAX = 32  # dimensions of one tensor
DTYPES = ("float32", "bfloat16", "float16")

_LAYOUT_FORMAT = 1  # bumped whenever the digested description changes shape


class LayoutError(UserError, ValueError):
    """A tensor list or layout request that cannot be laid out; the message says what is wrong."""


class TooManyFragments(LayoutError):
    """More fragments asked for than the model has tensors (or layers, for the layer strategy) to
    fill them. Carries the numbers, so that whoever chose P can be told what to choose instead."""

    def __init__(self, strategy: str, fragments: int, parts: int, unit: str) -> None:
        super().__init__(f"{strategy} strategy: {fragments} fragments but only {parts} {unit}")
        self.fragments = fragments  # P asked for
        self.parts = parts  # what there is to deal out: the most fragments this model can have
        self.unit = unit  # "tensors" or "layers"


class Strategy(str, enum.Enum):
    LAYER = "layer"
    TENSOR = "tensor"
    BALANCED = "balanced"


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of the model. `embedding` tensors are merged by weighted mean, never RDA."""

    path: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    embedding: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise LayoutError(f"tensor path must be a non-empty string, got {self.path!r}")
        if len(self.path) > PATH_CHARS_MAX:
            raise LayoutError(f"tensor path longer than {PATH_CHARS_MAX} characters: {self.path[:40]!r}...")
        if PATH_RE.fullmatch(self.path) is None:
            raise LayoutError(f"tensor path {self.path[:40]!r} holds a character that is not printable ASCII")
        try:
            shape = tuple(self.shape)
        except TypeError:
            raise LayoutError(
                f"tensor {self.path!r}: shape must be a sequence of integers, got {self.shape!r}"
            ) from None
        if any((not isinstance(d, (int, np.integer))) or isinstance(d, bool) or d < 0 for d in shape):
            raise LayoutError(f"tensor {self.path!r}: shape must be non-negative integers, got {self.shape!r}")
        if len(shape) > DIMS_MAX or any(d > FRAGMENT_ELEMENTS_MAX for d in shape):
            raise LayoutError(
                f"tensor {self.path!r}: shape {str(shape)[:60]} has more than {DIMS_MAX} dimensions or one above"
                f" {FRAGMENT_ELEMENTS_MAX} (no fragment holds that many elements)"
            )
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise LayoutError(f"tensor {self.path!r}: dtype {self.dtype!r} is not one of {DTYPES}")

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Segment:
    """Where one tensor lives inside its fragment's flat buffer."""

    tensor: TensorSpec
    offset: int  # first element in the fragment

    @property
    def stop(self) -> int:
        return self.offset + self.tensor.size


@dataclass(frozen=True)
class FragmentSpec:
    index: int
    segments: tuple[Segment, ...]
    padded_size: int  # elements, a multiple of the block

    @property
    def size(self) -> int:
        """Elements that belong to tensors (the rest up to `padded_size` is zero padding)."""
        return self.segments[-1].stop if self.segments else 0

    @property
    def offsets(self) -> np.ndarray:
        """int64[k+1] segment boundaries, the form the segment kernels take."""
        bounds = [s.offset for s in self.segments] + [self.size]
        return np.asarray(bounds, dtype=np.int64)

    @property
    def embedding_mask(self) -> np.ndarray:
        """bool[k]: which segments are embedding tensors (mean-merged)."""
        return np.asarray([s.tensor.embedding for s in self.segments], dtype=bool)


@dataclass(frozen=True)
class Layout:
    strategy: Strategy
    block: int
    fragments: tuple[FragmentSpec, ...]

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return tuple(s.tensor for f in self.fragments for s in f.segments)

    def describe(self) -> dict:
        """The canonical, JSON-able description that the digest covers (and checkpoints store)."""
        return {
            "format": _LAYOUT_FORMAT,
            "strategy": self.strategy.value,
            "block": self.block,
            "fragments": [
                [[s.tensor.path, list(s.tensor.shape), s.tensor.dtype, s.tensor.embedding] for s in f.segments]
                for f in self.fragments
            ],
        }

    @functools.cached_property
    def digest(self) -> str:
        # Cached: the layout never changes, and the syncer's view of its state names it each time it is taken.
        return hashlib.sha256(orjson.dumps(self.describe())).hexdigest()

    def locate(self, path: str) -> tuple[int, Segment]:
        """(fragment index, segment) of the tensor at `path`."""
        for f in self.fragments:
            for s in f.segments:
                if s.tensor.path == path:
                    return f.index, s
        raise LayoutError(f"no tensor {path!r} in this layout")


def build_layout(
    tensors: Sequence[TensorSpec], num_fragments: int, strategy: Strategy | str = Strategy.BALANCED, block: int = 128
) -> Layout:
    """Cut `tensors` into `num_fragments` disjoint fragments with the given strategy."""
    strategy = _parse_strategy(strategy)
    tensors = _validate_tensors(tensors)
    if not isinstance(num_fragments, int) or not 1 <= num_fragments <= FRAGMENTS_MAX:
        raise LayoutError(f"number of fragments must be an integer in [1, {FRAGMENTS_MAX}], got {num_fragments!r}")
    if not isinstance(block, int) or block < 8 or block % 8:
        raise LayoutError(f"block must be a positive multiple of 8, got {block!r}")
    assign = {Strategy.LAYER: _assign_layer, Strategy.TENSOR: _assign_tensor, Strategy.BALANCED: _assign_balanced}
    groups = assign[strategy](tensors, num_fragments)
    fragments = tuple(_fragment(i, members, block) for i, members in enumerate(groups))
    return Layout(strategy=strategy, block=block, fragments=fragments)


def layout_from_description(description: dict) -> Layout:
    """Rebuild a layout from `Layout.describe()` (a checkpoint or an init file), validating it."""
    try:
        if description["format"] != _LAYOUT_FORMAT:
            raise LayoutError(f"layout format {description['format']!r} is not {_LAYOUT_FORMAT}")
        strategy = _parse_strategy(description["strategy"])
        block = int(description["block"])
        groups = [
            [TensorSpec(path, tuple(shape), dtype, bool(emb)) for path, shape, dtype, emb in fragment]
            for fragment in description["fragments"]
        ]
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, LayoutError):
            raise
        raise LayoutError(f"malformed layout description: {exc!r}") from exc
    _validate_tensors([t for g in groups for t in g])
    fragments = tuple(_fragment(i, members, block) for i, members in enumerate(groups))
    return Layout(strategy=strategy, block=block, fragments=fragments)


def peak_fragment_bound(tensors: Iterable[TensorSpec], num_fragments: int) -> float:
    """The ideal peak fragment size max(total/P, largest tensor) that balanced packing is measured by."""
    sizes = [t.size for t in tensors]
    return max(sum(sizes) / num_fragments, max(sizes))


def _parse_strategy(strategy: Strategy | str) -> Strategy:
    try:
        return Strategy(strategy)
    except ValueError:
        raise LayoutError(f"unknown fragment strategy {strategy!r}; one of {[s.value for s in Strategy]}") from None


def _validate_tensors(tensors: Sequence[TensorSpec]) -> list[TensorSpec]:
    tensors = list(tensors)
    if not tensors:
        raise LayoutError("a layout needs at least one tensor")
    if len(tensors) > TENSORS_MAX:
        raise LayoutError(f"{len(tensors)} tensors is more than the limit of {TENSORS_MAX}")
    seen: set[str] = set()
    for t in tensors:
        if not isinstance(t, TensorSpec):
            raise LayoutError(f"expected TensorSpec, got {type(t).__name__}")
        if t.path in seen:
            raise LayoutError(f"tensor path {t.path!r} appears twice")
        seen.add(t.path)
    return tensors


def _natural_key(path: str) -> tuple:
    """Sort key that orders 'blocks/10' after 'blocks/9' (paths are unique, so the order is total)."""
    return tuple((0, int(part), "") if _is_number(part) else (1, 0, part) for part in re.split(r"[/.]", path)), path


def _is_number(part: str) -> bool:
    """Whether a path component is a layer number: ASCII digits only, which `int` always reads."""
    return part.isascii() and part.isdigit()


def _tensor_key(t: TensorSpec) -> tuple:
    return _natural_key(t.path)


def _fragment(index: int, members: Sequence[TensorSpec], block: int) -> FragmentSpec:
    if not members:
        raise LayoutError(f"fragment {index} would be empty: use fewer fragments than tensors (or layers)")
    segments, offset = [], 0
    for t in sorted(members, key=_tensor_key):
        segments.append(Segment(tensor=t, offset=offset))
        offset += t.size
    padded = max(block, -(-offset // block) * block)
    if padded > FRAGMENT_ELEMENTS_MAX:
        raise LayoutError(f"fragment {index} has {offset} elements, above the limit of {FRAGMENT_ELEMENTS_MAX}")
    return FragmentSpec(index=index, segments=tuple(segments), padded_size=padded)


def _assign_tensor(tensors: list[TensorSpec], p: int) -> list[list[TensorSpec]]:
    ordered = sorted(tensors, key=_tensor_key)
    if p > len(ordered):
        raise TooManyFragments("tensor", p, len(ordered), "tensors")
    return [ordered[i::p] for i in range(p)]


def _assign_balanced(tensors: list[TensorSpec], p: int) -> list[list[TensorSpec]]:
    """LPT greedy: largest tensor first into the lightest fragment; ties by path, then lowest index."""
    if p > len(tensors):
        raise TooManyFragments("balanced", p, len(tensors), "tensors")
    ordered = sorted(tensors, key=lambda t: (-t.size, _natural_key(t.path)))
    loads = [0] * p
    groups: list[list[TensorSpec]] = [[] for _ in range(p)]
    for t in ordered:
        lightest = min(range(p), key=lambda i: (loads[i], i))
        groups[lightest].append(t)
        loads[lightest] += t.size
    return groups


def _layer_key(path: str) -> str:
    """The layer a tensor belongs to: its path up to the first all-digit component ('blocks/3'), else
    its first component ('embed', 'final_norm'), so non-block tensors form groups of their own."""
    parts = re.split(r"[/.]", path)
    for i, part in enumerate(parts):
        if _is_number(part):
            return "/".join(parts[: i + 1])
    return parts[0]


def _assign_layer(tensors: list[TensorSpec], p: int) -> list[list[TensorSpec]]:
    """One layer per fragment; with fewer fragments than layers, consecutive layers share one."""
    by_layer: dict[str, list[TensorSpec]] = {}
    for t in sorted(tensors, key=_tensor_key):
        by_layer.setdefault(_layer_key(t.path), []).append(t)
    layers = sorted(by_layer, key=_natural_key)
    if p > len(layers):
        raise TooManyFragments("layer", p, len(layers), "layers")
    groups: list[list[TensorSpec]] = [[] for _ in range(p)]
    for g, name in enumerate(layers):
        groups[g * p // len(layers)].extend(by_layer[name])
    return groups
