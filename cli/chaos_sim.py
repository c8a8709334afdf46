"""`ddiloco chaos-sim`: the deterministic simulation test of the syncer, over many seeds.

    ddiloco chaos-sim --seeds 0-999 [--jobs N] [--json PATH]
    ddiloco chaos-sim --seeds 17 --verbose 17       (the whole trace of one seed)

Each seed draws a world and a fault plan, runs the real syncer core under it (safety phase, then
liveness phase: docs/chaos-sim.md) and passes or names the first broken invariant. The summary gives
seeds, passed, failed, events simulated and time; every failing seed is printed with the command
that reproduces it. The exit status is 1 when any seed fails.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ddiloco.errors import FaultError, UserError

SEEDS_MAX = 1_000_000  # seeds in one invocation
JOBS_MAX = 256
TAIL_PRINTED = 12  # trace lines printed under a failing seed


def parse_seeds(text: str) -> list[int]:
    """'0-999', '17' or '1,5,9-12' -> the seeds, in order, without repeats."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise argparse.ArgumentTypeError(f"seeds are whole numbers or ranges like 0-999, got {part.strip()!r}")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise argparse.ArgumentTypeError(f"seed range {part.strip()!r} runs backwards")
        if len(seeds) + last - first + 1 > SEEDS_MAX:
            raise argparse.ArgumentTypeError(f"at most {SEEDS_MAX} seeds per run")
        seeds.extend(range(first, last + 1))
    return list(dict.fromkeys(seeds))


def _jobs(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= JOBS_MAX:
        raise argparse.ArgumentTypeError(f"--jobs must be a whole number in [1, {JOBS_MAX}], got {text!r}")
    return int(text)


def _seed(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a seed (a whole number), got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seeds",
        type=parse_seeds,
        default=parse_seeds("0-99"),
        help="seeds to run: 0-999, 17 or 1,5,9-12 (default 0-99)",
    )
    parser.add_argument("--jobs", type=_jobs, default=1, help="worker processes (spawned; default 1)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every result as JSON")
    parser.add_argument(
        "--verbose", type=_seed, metavar="SEED", help="print the whole trace of this seed (it must be among --seeds)"
    )
    parser.add_argument(
        "--client-as-is",
        action="store_true",
        help="learners send an old session's queued messages under a new learner id, as net/client.py does",
    )


def run(args: argparse.Namespace) -> int:
    from ddiloco.chaos.faults import ChaosConfig

    if args.verbose is not None and args.verbose not in args.seeds:
        raise UserError(f"--verbose {args.verbose} is not among the seeds to run")
    config = ChaosConfig(client_as_is=args.client_as_is)
    print(f"chaos-sim: {len(args.seeds)} seeds, {args.jobs} job(s), {config}", flush=True)
    started = time.perf_counter()
    results = _run_all(args.seeds, config, args.jobs, args.verbose)
    seconds = time.perf_counter() - started
    failed = [r for r in results if not r.passed]
    for r in failed:
        _print_failure(r, args.client_as_is)
    events = sum(r.events for r in results)
    actions = sum(r.actions for r in results)
    print(
        f"seeds {len(results)}, passed {len(results) - len(failed)}, failed {len(failed)}; "
        f"{events} core events and {actions} simulated actions in {seconds:.1f} s"
    )
    if args.json:
        _write_json(args.json, results, seconds)
    return 1 if failed else 0


def _run_all(seeds: list[int], config, jobs: int, verbose: int | None) -> list:
    from ddiloco.chaos.run import run_seed

    by_seed = {}
    if verbose is not None:
        by_seed[verbose] = run_seed(verbose, config, echo=print)
    rest = [s for s in seeds if s not in by_seed]
    if jobs == 1 or len(rest) < 2:
        for s in rest:
            by_seed[s] = run_seed(s, config)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        from functools import partial

        # spawn, never fork: numba's threading layer does not survive a fork
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            chunk = max(1, min(50, len(rest) // (4 * jobs)))
            for result in pool.map(partial(run_seed, config=config), rest, chunksize=chunk):
                by_seed[result.seed] = result
    return [by_seed[s] for s in seeds]


def _print_failure(r, as_is: bool) -> None:
    where = f" at t={r.at:.3f} s" if r.at is not None else ""
    flag = " --client-as-is" if as_is else ""
    print(f"FAILED seed {r.seed}: {r.failure}: {r.detail}{where}")
    print(f"  reproduce: ddiloco chaos-sim --seeds {r.seed} --verbose {r.seed}{flag}")
    for line in r.trace_tail[-TAIL_PRINTED:]:
        print(f"  | {line}")


def _write_json(path: Path, results: list, seconds: float) -> None:
    keep = (
        "seed",
        "passed",
        "failure",
        "detail",
        "at",
        "events",
        "actions",
        "merges",
        "faults",
        "trace_hash",
        "state_hash",
    )
    doc = {
        "seeds": len(results),
        "passed": sum(r.passed for r in results),
        "failed": sum(not r.passed for r in results),
        "events": sum(r.events for r in results),
        "actions": sum(r.actions for r in results),
        "seconds": round(seconds, 3),
        "results": [
            {k: getattr(r, k) for k in keep}
            | ({} if r.passed else {"plan": list(r.plan), "trace_tail": list(r.trace_tail)})
            for r in results
        ],
    }
    try:
        path.write_text(json.dumps(doc, indent=1))
    except OSError as exc:
        raise FaultError(
            f"cannot write {path}: {exc.strerror}",
            what_to_do="the seeds ran (see above): give --json a writable path to keep their results",
        ) from exc
