"""Merge-throughput benchmark: every kernel of the syncer's merge path against three baselines.

For each kernel: the best time of `repeat` runs, the compulsory memory traffic it implies (each input
byte read once, each output byte written once) in GB/s, that rate as a share of the machine's memory
bandwidth ceiling measured in the same run (an in-place `b += c` over all of numba's threads), the
speed-up over the plain-numpy reference (`vs_numpy` = numpy time / our time) and over equivalent
PyTorch CPU code where torch is importable. Inputs are allocated and first touched before anything is
timed, every kernel is compiled first, and slow references run fewer times (at least once) within a
time budget.

Rows beyond the single kernels: a whole round of the syncer (M = 2, 4, 8, 16 int4 contributions merged
by the mean and the outer step taken) fused in one pass against one kernel pass per contribution plus
the step, an RDA round likewise, the RDA round's accumulate with the sums of squares of its result taken
in the same pass against segment_sumsq after it, and the learner's encode (outer gradient + int4 +
error feedback) and apply of an int4 delta in one pass against the numpy-and-kernels path they replace.
A round's rows count the same compulsory traffic fused or not, so their shares of the ceiling compare
directly.

Every kernel of ours is timed before any baseline runs: PyTorch's OpenMP threads may keep spinning for
a while after each of its calls, and a kernel timed right after a torch baseline would share the cores
with them. Mind the last-level cache when reading a row: a working set that fits in it (16M elements
on a host with 300 MiB of L3) streams from cache, and the ceiling then is the cache's.

Run it as `ddiloco bench merge [--elements 64M] [--repeat 5] [--json PATH]`; it sizes itself from the
host (numba's thread count, printed in the title), so the same command serves 2 cores and 96.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np
from numba import njit, prange

from ddiloco import kernels
from ddiloco.kernels import reference

ELEMENTS_DEFAULT = 64 * 2**20
REPEAT_DEFAULT = 5
ELEMENTS_ALIGN = 1024  # the bench rounds the size up to this: every block codec needs whole blocks
SEGMENTS_DEFAULT = 256  # tensors in the synthetic fragment for the RDA kernels
PADDING_ELEMENTS = 100  # zeros after the last tensor, as core pads fragments
BASELINE_BUDGET_S = 4.0  # a baseline stops repeating once its runs have taken this long
LEARNING_RATE = 0.7  # the outer optimizer's default (docs/algorithm.md, "Syncer: one round of fragment p", item 6)
MOMENTUM = 0.9
ROUND_LEARNERS = (2, 4, 8, 16)  # contributions per round in the fused-merge rows
RDA_ROUND_LEARNERS = 4


@dataclass(frozen=True)
class MergeBenchConfig:
    elements: int = ELEMENTS_DEFAULT
    repeat: int = REPEAT_DEFAULT
    seed: int = 0
    torch: bool = True  # compare with PyTorch when it is importable
    baseline_budget_s: float = BASELINE_BUDGET_S

    def __post_init__(self) -> None:
        if self.elements < 1:
            raise ValueError(f"elements must be positive, got {self.elements}")
        if self.repeat < 1:
            raise ValueError(f"repeat must be at least 1, got {self.repeat}")
        if not self.baseline_budget_s > 0:
            raise ValueError(f"baseline_budget_s must be positive, got {self.baseline_budget_s}")

    @property
    def aligned_elements(self) -> int:
        return -(-self.elements // ELEMENTS_ALIGN) * ELEMENTS_ALIGN


@dataclass(frozen=True)
class KernelTiming:
    name: str
    elements: int
    bytes: int  # compulsory traffic of one call
    seconds: float
    gbps: float
    ceiling_gbps: float
    numpy_seconds: float | None
    torch_seconds: float | None

    @property
    def of_ceiling(self) -> float:
        return self.gbps / self.ceiling_gbps

    @property
    def vs_numpy(self) -> float | None:
        return None if self.numpy_seconds is None else self.numpy_seconds / self.seconds

    @property
    def vs_torch(self) -> float | None:
        return None if self.torch_seconds is None else self.torch_seconds / self.seconds

    def as_json(self) -> dict:
        record = dataclasses.asdict(self)
        record.update(of_ceiling=self.of_ceiling, vs_numpy=self.vs_numpy, vs_torch=self.vs_torch)
        return record


@dataclass(frozen=True)
class _Case:
    name: str
    bytes_per_element: float  # compulsory traffic, scales included
    ours: Callable[[], object]
    numpy: Callable[[], object] | None
    torch: Callable[[], object] | None


# ---- the bandwidth ceiling ----


@njit(parallel=True, nogil=True, cache=True)
def _stream_add(b, c):
    # b: f32[n] (in place), c: f32[n]. 8 bytes read and 4 written per element, nothing to compute:
    # the fastest an in-place pass over memory goes on all cores.
    for i in prange(b.size):
        b[i] += c[i]


CEILING_BYTES_PER_ELEMENT = 12


def _best_seconds(fn: Callable[[], object], repeat: int, budget_s: float = math.inf) -> float:
    """Best wall time of up to `repeat` calls; stops early once the calls have used `budget_s`."""
    best = math.inf
    spent = 0.0
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best = min(best, took)
        spent += took
        if spent >= budget_s:
            break
    return best


# ---- inputs and cases ----


def _synthetic_offsets(elements: int, rng: np.random.Generator) -> np.ndarray:
    """A fragment-like layout: tensors of log-normal sizes (a few large, many small), then padding."""
    covered = elements - PADDING_ELEMENTS
    weights = rng.lognormal(mean=0.0, sigma=1.5, size=SEGMENTS_DEFAULT)
    sizes = np.floor(weights / weights.sum() * covered).astype(np.int64)
    offsets = np.zeros(SEGMENTS_DEFAULT + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return offsets


def _zeros(n: int, dtype: type) -> np.ndarray:
    # np.zeros may hand out untouched pages (calloc) whose faults would land in the timed region;
    # filling writes every page now.
    return np.full(n, 0, dtype=dtype)


def _numpy_cases(n: int, rng: np.random.Generator) -> list[_Case]:
    block = kernels.BLOCK_DEFAULT
    scale_bytes = 4 / block
    x = rng.standard_normal(n, dtype=np.float32)
    acc = _zeros(n, np.float32)
    theta = rng.standard_normal(n, dtype=np.float32)
    buf = _zeros(n, np.float32)
    out = _zeros(n, np.float32)
    u16 = kernels.to_bf16(x)
    u16_out = _zeros(n, np.uint16)
    codes4, scales4 = kernels.quantize_int4(x, block)
    codes2, scales2 = kernels.quantize_int2(x, block)
    codes1, scales1 = kernels.quantize_int1(x, block)
    offsets = _synthetic_offsets(n, rng)
    norms = np.sqrt(kernels.segment_sumsq(x, offsets))
    w = 0.25
    r = reference
    k = kernels
    return [
        _Case("accumulate", 12, lambda: k.accumulate(acc, w, x), lambda: r.accumulate(acc, w, x), None),
        _Case(
            "accumulate_int4",
            8 + 1 / 2 + scale_bytes,
            lambda: k.accumulate_int4(acc, w, codes4, scales4, block),
            lambda: r.accumulate_int4(acc, w, codes4, scales4, block),
            None,
        ),
        _Case(
            "rda_accumulate",
            12,
            lambda: k.rda_accumulate(acc, w, x, offsets, norms),
            lambda: r.rda_accumulate(acc, w, x, offsets, norms),
            None,
        ),
        _Case(
            "rda_accumulate_int4",
            8 + 1 / 2 + scale_bytes,
            lambda: k.rda_accumulate_int4(acc, w, codes4, scales4, offsets, norms, block),
            lambda: r.rda_accumulate_int4(acc, w, codes4, scales4, offsets, norms, block),
            None,
        ),
        _Case("segment_sumsq", 4, lambda: k.segment_sumsq(x, offsets), lambda: r.segment_sumsq(x, offsets), None),
        _Case(
            "segment_sumsq_int4",
            1 / 2 + scale_bytes,
            lambda: k.segment_sumsq_int4(codes4, scales4, offsets, block),
            lambda: r.segment_sumsq_int4(codes4, scales4, offsets, block),
            None,
        ),
        _Case(
            "nesterov_step",
            20,
            lambda: k.nesterov_step(theta, buf, x, LEARNING_RATE, MOMENTUM),
            lambda: r.nesterov_step(theta, buf, x, LEARNING_RATE, MOMENTUM),
            None,
        ),
        _Case(
            "quantize_int4",
            4 + 1 / 2 + scale_bytes,
            lambda: k.quantize_int4(x, block),
            lambda: r.quantize_int4(x, block),
            None,
        ),
        _Case(
            "dequantize_int4",
            1 / 2 + scale_bytes + 4,
            lambda: k.dequantize_int4(codes4, scales4, block, out=out),
            lambda: r.dequantize_int4(codes4, scales4, block, out=out),
            None,
        ),
        _Case(
            "accumulate_int2",
            8 + 1 / 4 + scale_bytes,
            lambda: k.accumulate_int2(acc, w, codes2, scales2, block),
            lambda: r.accumulate_int2(acc, w, codes2, scales2, block),
            None,
        ),
        _Case(
            "quantize_int2",
            4 + 1 / 4 + scale_bytes,
            lambda: k.quantize_int2(x, block),
            lambda: r.quantize_int2(x, block),
            None,
        ),
        _Case(
            "accumulate_int1",
            8 + 1 / 8 + scale_bytes,
            lambda: k.accumulate_int1(acc, w, codes1, scales1, block),
            lambda: r.accumulate_int1(acc, w, codes1, scales1, block),
            None,
        ),
        _Case(
            "quantize_int1",
            4 + 1 / 8 + scale_bytes,
            lambda: k.quantize_int1(x, block),
            lambda: r.quantize_int1(x, block),
            None,
        ),
        _Case("to_bf16", 6, lambda: k.to_bf16(x, out=u16_out), lambda: r.to_bf16(x, out=u16_out), None),
        _Case("from_bf16", 6, lambda: k.from_bf16(u16, out=out), lambda: r.from_bf16(u16, out=out), None),
        _Case("all_finite", 4, lambda: k.all_finite(x), lambda: r.all_finite(x), None),
        *_round_cases(n, rng, theta, buf),
        *_learner_cases(n, rng),
    ]


def _round_cases(n: int, rng: np.random.Generator, theta: np.ndarray, buf: np.ndarray) -> list[_Case]:
    """A syncer round: M int4 contributions merged and the outer step taken, fused (one pass) and as one
    accumulate per contribution plus the step (the path before the fused kernels)."""
    block = kernels.BLOCK_DEFAULT
    int4_bytes = 1 / 2 + 4 / block
    k = kernels
    coded = [k.quantize_int4(rng.standard_normal(n, dtype=np.float32), block) for _ in range(max(ROUND_LEARNERS))]
    scratch = _zeros(n, np.float32)
    cases = []
    for m in ROUND_LEARNERS:
        weights = np.full(m, 1.0 / m)
        codes, scales = [c for c, _ in coded[:m]], [s for _, s in coded[:m]]
        traffic = m * int4_bytes + 16  # every contribution read once; theta and buf read and written

        def per_learner(weights=weights, codes=codes, scales=scales) -> None:
            scratch.fill(0.0)
            for w, c, sc in zip(weights, codes, scales):
                k.accumulate_int4(scratch, w, c, sc, block)
            k.nesterov_step(theta, buf, scratch, LEARNING_RATE, MOMENTUM)

        def fused(weights=weights, codes=codes, scales=scales) -> None:
            k.round_mean_step_int4(theta, buf, weights, codes, scales, LEARNING_RATE, MOMENTUM, block)

        def numpy(weights=weights, codes=codes, scales=scales) -> None:
            reference.round_mean_step_int4(theta, buf, weights, codes, scales, LEARNING_RATE, MOMENTUM, block)

        cases.append(_Case(f"round mean int4 M={m}, fused", traffic, fused, numpy, None))
        cases.append(_Case(f"round mean int4 M={m}, per learner", traffic, per_learner, None, None))
    m = RDA_ROUND_LEARNERS
    weights = np.full(m, 1.0 / m)
    codes, scales = [c for c, _ in coded[:m]], [s for _, s in coded[:m]]
    offsets = _synthetic_offsets(n, rng)
    norms = np.stack([np.sqrt(k.segment_sumsq_int4(c, sc, offsets, block)) for c, sc in zip(codes, scales)])
    factors = np.full(offsets.size - 1, 0.5, dtype=np.float32)
    # after the norms (codes only): the unit vectors summed (acc written; the sum's norms taken from
    # cache as it goes, so no traffic of their own), the scaled step (acc read, theta and buf read and
    # written). The per-learner path reads acc once more for the sum's norms, beyond this figure.
    rda_traffic = m * int4_bytes + 4 + 20

    def rda_fused() -> None:
        scratch.fill(0.0)
        k.rda_accumulate_round_int4_sumsq(scratch, weights, codes, scales, offsets, norms, block)
        k.nesterov_step_segments(theta, buf, scratch, offsets, factors, LEARNING_RATE, MOMENTUM)

    def rda_per_learner() -> None:
        scratch.fill(0.0)
        for i in range(m):
            k.rda_accumulate_int4(scratch, weights[i], codes[i], scales[i], offsets, norms[i], block)
        k.segment_sumsq(scratch, offsets)
        for i in range(offsets.size - 1):
            scratch[offsets[i] : offsets[i + 1]] *= factors[i]
        k.nesterov_step(theta, buf, scratch, LEARNING_RATE, MOMENTUM)

    cases.append(_Case(f"round rda int4 M={m}, fused", rda_traffic, rda_fused, None, None))
    cases.append(_Case(f"round rda int4 M={m}, per learner", rda_traffic, rda_per_learner, None, None))
    # The accumulate alone, with the merged direction's sums of squares: taken in the same pass, and
    # by segment_sumsq after it (the syncer's path before). Every contribution read once, acc read and
    # written in place (not zeroed between runs: the values stay small, and a fill would be a third
    # pass); the second call's extra read of acc is what the fused one saves.
    accumulate_traffic = m * int4_bytes + 8

    def accumulate_sumsq_fused() -> None:
        k.rda_accumulate_round_int4_sumsq(scratch, weights, codes, scales, offsets, norms, block)

    def accumulate_then_sumsq() -> None:
        k.rda_accumulate_round_int4(scratch, weights, codes, scales, offsets, norms, block)
        k.segment_sumsq(scratch, offsets)

    name = f"rda accumulate int4 M={m}"
    cases.append(_Case(f"{name} + sums of squares, fused", accumulate_traffic, accumulate_sumsq_fused, None, None))
    cases.append(_Case(f"{name}, then segment_sumsq", accumulate_traffic, accumulate_then_sumsq, None, None))
    return cases


def _learner_cases(n: int, rng: np.random.Generator) -> list[_Case]:
    """The learner's side: its outer gradient encoded with error feedback, and an arrived int4 delta
    applied onto its published copy with the difference to the kept progress's anchor, each one pass
    (on the pool, as on a learner host with cores to spare), against the same done with numpy
    expressions around the single kernels."""
    block = kernels.BLOCK_DEFAULT
    int4_bytes = 1 / 2 + 4 / block
    k = kernels
    base = rng.standard_normal(n, dtype=np.float32)
    theta = base - rng.standard_normal(n, dtype=np.float32) * np.float32(0.01)
    residual = rng.standard_normal(n, dtype=np.float32) * np.float32(0.001)
    codes, scales = k.quantize_int4(base - theta, block)

    def encode_composed() -> None:
        target = (base - theta) + residual
        c, sc = k.quantize_int4(target, block)
        _ = target - k.dequantize_int4(c, sc, block)

    def apply_composed() -> None:
        published = base.copy()
        k.add_delta_int4(published, codes, scales, block)
        _ = published - theta

    return [
        # base, theta and residual read; codes, scales and the new residual written
        _Case(
            "learner encode int4 + feedback",
            12 + int4_bytes + 4,
            lambda: k.quantize_delta_int4(base, theta, residual, block),
            encode_composed,
            None,
        ),
        _Case(
            "learner encode, serial",
            12 + int4_bytes + 4,
            lambda: k.quantize_delta_int4(base, theta, residual, block, parallel=False),
            None,
            None,
        ),
        # the delta, the published copy it goes onto and the kept progress's anchor read; the new
        # published copy and its difference to the anchor written
        _Case(
            "learner apply int4 delta + kept progress",
            int4_bytes + 16,
            lambda: k.add_delta_apart_int4(base, theta, codes, scales, block),
            apply_composed,
            None,
        ),
    ]


def _torch_baselines(cases: list[_Case], n: int, rng: np.random.Generator) -> list[_Case]:
    """The same cases with PyTorch CPU equivalents attached where there is a natural one."""
    import torch

    block = kernels.BLOCK_DEFAULT
    half = block // 2
    x = torch.from_numpy(rng.standard_normal(n, dtype=np.float32))
    acc = torch.zeros(n)
    out = torch.zeros(n)
    codes_np, scales_np = kernels.quantize_int4(x.numpy(), block)
    codes = torch.from_numpy(codes_np).view(-1, half)
    scales = torch.from_numpy(scales_np)[:, None]
    u16 = torch.from_numpy(kernels.to_bf16(x.numpy())).view(torch.bfloat16)
    w = 0.25

    def dequantize_into(dest: torch.Tensor) -> torch.Tensor:
        low = torch.bitwise_and(codes, 15).to(torch.float32) - 8
        high = torch.bitwise_right_shift(codes, 4).to(torch.float32) - 8
        torch.mul(torch.cat([low, high], dim=1), scales, out=dest.view(-1, block))
        return dest

    def quantize() -> tuple[torch.Tensor, torch.Tensor]:
        xb = x.view(-1, block)
        scale = xb.abs().amax(dim=1, keepdim=True) / 7
        q = torch.round(xb / torch.where(scale > 0, scale, 1.0)).clamp_(-7, 7).to(torch.uint8) + 8
        return torch.bitwise_or(q[:, :half], torch.bitwise_left_shift(q[:, half:], 4)), scale

    param = torch.nn.Parameter(torch.from_numpy(rng.standard_normal(n, dtype=np.float32)))
    param.grad = x.clone()
    sgd = torch.optim.SGD([param], lr=LEARNING_RATE, momentum=MOMENTUM, nesterov=True)
    sgd.step()  # the first step only creates the momentum buffer

    def sgd_step() -> None:
        with torch.no_grad():
            sgd.step()

    scratch = torch.zeros(n)

    baselines: dict[str, Callable[[], object]] = {
        "accumulate": lambda: acc.add_(x, alpha=w),
        "accumulate_int4": lambda: acc.add_(dequantize_into(scratch), alpha=w),
        "nesterov_step": sgd_step,
        "quantize_int4": quantize,
        "dequantize_int4": lambda: dequantize_into(out),
        "to_bf16": lambda: x.to(torch.bfloat16),
        "from_bf16": lambda: u16.to(torch.float32),
        "all_finite": lambda: bool(torch.isfinite(x).all()),
    }
    return [dataclasses.replace(c, torch=baselines.get(c.name)) for c in cases]


def _torch_available(config: MergeBenchConfig) -> bool:
    return config.torch and importlib.util.find_spec("torch") is not None


def _measure_ceiling(n: int, repeat: int, rng: np.random.Generator) -> float:
    b = rng.standard_normal(n, dtype=np.float32)
    c = rng.standard_normal(n, dtype=np.float32)
    _stream_add(b, c)  # compile
    return CEILING_BYTES_PER_ELEMENT * n / _best_seconds(lambda: _stream_add(b, c), repeat) / 1e9


def run_merge_bench(config: MergeBenchConfig, progress: Callable[[str], None] | None = None) -> list[KernelTiming]:
    """Time every case; returns one KernelTiming per kernel, the ceiling first."""
    n = config.aligned_elements
    rng = np.random.default_rng(config.seed)
    kernels.warmup()
    cases = _numpy_cases(n, rng)
    if _torch_available(config):
        cases = _torch_baselines(cases, n, rng)
    # The ceiling is measured before and after the kernels and the better figure kept, so that a
    # quiet moment on a shared machine raises the bar rather than flattering the kernels.
    ceiling = _measure_ceiling(n, config.repeat, rng)
    ours = {}
    for case in cases:
        if progress:
            progress(case.name)
        case.ours()  # first call outside the timing (caches, lazily built plans)
        ours[case.name] = _best_seconds(case.ours, config.repeat)
    ceiling = max(ceiling, _measure_ceiling(n, config.repeat, rng))
    # The baselines only after every kernel of ours (see the module docstring: torch's spinning threads).
    timings = []
    for case in cases:
        if progress and (case.numpy or case.torch):
            progress(f"{case.name} (baselines)")
        numpy_s = _best_seconds(case.numpy, config.repeat, config.baseline_budget_s) if case.numpy else None
        torch_s = None
        if case.torch is not None:
            case.torch()
            torch_s = _best_seconds(case.torch, config.repeat, config.baseline_budget_s)
        traffic = int(round(case.bytes_per_element * n))
        timings.append((case.name, traffic, ours[case.name], numpy_s, torch_s))
    ceiling_row = KernelTiming(
        "ceiling (b += c)",
        n,
        CEILING_BYTES_PER_ELEMENT * n,
        CEILING_BYTES_PER_ELEMENT * n / ceiling / 1e9,
        ceiling,
        ceiling,
        None,
        None,
    )
    return [ceiling_row] + [
        KernelTiming(name, n, traffic, s, traffic / s / 1e9, ceiling, numpy_s, torch_s)
        for name, traffic, s, numpy_s, torch_s in timings
    ]


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def format_table(timings: list[KernelTiming], config: MergeBenchConfig) -> str:
    """Plain text, aligned columns, one row per kernel."""
    header = ("kernel", "ms", "GB/s", "of ceiling", "vs numpy", "vs torch")
    rows = [
        (
            t.name,
            f"{t.seconds * 1e3:.2f}",
            f"{t.gbps:.1f}",
            f"{t.of_ceiling * 100:.0f}%",
            _ratio(t.vs_numpy),
            _ratio(t.vs_torch),
        )
        for t in timings
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    n = config.aligned_elements
    title = (
        f"merge kernels: {n} float32 elements ({n * 4 / 2**20:.0f} MiB), best of {config.repeat}, "
        f"block {kernels.BLOCK_DEFAULT}, {numba.get_num_threads()} threads; GB/s of compulsory traffic"
    )
    return "\n".join([title, line(header), line(tuple("-" * w for w in widths)), *map(line, rows)])


def timings_json(timings: list[KernelTiming]) -> list[dict]:
    return [t.as_json() for t in timings]
