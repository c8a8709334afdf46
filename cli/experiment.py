"""`ddiloco experiment`: the paper's experiments at our scale, in one process on a virtual clock.

    ddiloco experiment NAME [--quick] [--json PATH] [--plot PATH] [--budget-tokens N] [--seeds N]
    ddiloco experiment all [--quick] --results docs/results.md      (tables and plots for every experiment)
    ddiloco experiment all --from-json A.json B.json --results docs/results.md   (the page from saved runs)

NAME is one of dp-vs-decoupled, failures, merge, compression, broadcast, fragments, hetero,
scavenge, demo-settings, or all.
Every experiment runs over at least 3 seeds and prints mean and spread per arm. `--results` writes
the Markdown results page and its PNG plots (in a `results/` folder beside it). The first line
printed is the resolved size.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

from ddiloco.cli import user_input
from ddiloco.errors import UserError

NAMES = (
    "dp-vs-decoupled",
    "failures",
    "merge",
    "compression",
    "broadcast",
    "fragments",
    "hetero",
    "scavenge",
    "demo-settings",
    "demo-gap",
)
SEEDS_MAX = 100


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=NAMES + ("all",), help="the experiment, or all of them")
    p.add_argument("--quick", action="store_true", help="the tiny size (about a minute per experiment)")
    p.add_argument("--seeds", type=_positive_int, help="seeds 0..N-1 (at least 3; default 3)")
    p.add_argument(
        "--budget-tokens",
        type=_positive_int,
        metavar="N",
        help="token budget of the M = 4 runs (other M scale with it); default: the size's",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", type=Path, metavar="PATH", help="draw the experiment's plot (PNG; one experiment only)")
    p.add_argument("--results", type=Path, metavar="PATH", help="write the Markdown results page (plots beside it)")
    p.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        metavar="PATH",
        help="run nothing: take the results from JSON files written by --json (the first of each name wins)",
    )


def run(args: argparse.Namespace) -> int:
    from ddiloco.cli import require_learner_extra

    require_learner_extra()
    from ddiloco.experiments import catalog as experiments
    from ddiloco.experiments import results_page as results
    from ddiloco.reference.model import enable_compilation_cache

    if args.plot and args.name == "all":
        raise UserError("--plot draws one experiment; use --results for all of them")
    if args.seeds is not None and not experiments.SEEDS_MIN <= args.seeds <= SEEDS_MAX:
        raise UserError(f"--seeds must lie in [{experiments.SEEDS_MIN}, {SEEDS_MAX}], got {args.seeds}")
    size = experiments.QUICK if args.quick else experiments.DEFAULT
    with user_input():  # the size checks the values the flags gave
        if args.seeds:
            size = replace(size, seeds=tuple(range(args.seeds)))
        if args.budget_tokens:
            size = replace(size, budget_tokens=args.budget_tokens)
    enable_compilation_cache()
    # Late and stale answers are expected outcomes here (the ledger counts them), not warnings to print.
    logging.getLogger("ddiloco.learner").setLevel(logging.ERROR)
    names = NAMES if args.name == "all" else (args.name,)
    if args.from_json:
        done = _load(args.from_json, names)
        names = ()
    else:
        print(f"size: {size}", flush=True)
        done = []
    for name in names:
        started = time.perf_counter()
        result = experiments.run_experiment(
            experiments.EXPERIMENTS[name], size, progress=lambda line: print(line, file=sys.stderr, flush=True)
        )
        result["host_s"] = time.perf_counter() - started
        done.append(result)
        print(f"\n{name} ({result['host_s']:.0f} s)\n{results.table(result)}\n{result['verdict']}", flush=True)
        if args.plot:
            results.plot(result, args.plot)
    if args.json:
        args.json.write_text(json.dumps(done, indent=2) + "\n")
    if args.results:
        plots = {}
        for result in done:
            plots[result["experiment"]] = f"{result['experiment']}.png"
            results.plot(result, args.results.parent / "results" / plots[result["experiment"]])
        args.results.write_text(results.page(done, plots))
        print(f"wrote {args.results}")
    return 0


def _load(paths: list[Path], names: tuple[str, ...]) -> list[dict]:
    """Saved results in the order of `names`; a clear error for a missing file or experiment."""
    from ddiloco.experiments import catalog as experiments

    found: dict[str, dict] = {}
    for path in paths:
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read results from {path}: {exc}") from exc
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "experiment" in e for e in entries):
            raise UserError(f"{path} is not a results file written by `ddiloco experiment --json`")
        for entry in entries:
            found.setdefault(entry["experiment"], entry)
    missing = [n for n in names if n not in found]
    if missing:
        raise UserError(f"no saved results for {', '.join(missing)} in {', '.join(map(str, paths))}")
    return [experiments.refresh(found[n]) for n in names]
