"""`ddiloco bench KIND`: run one benchmark, print its table, optionally write its results as JSON.

Each kind is an entry of KINDS: its help line, a function adding its flags and a function running it.
A kind's runner imports its benchmark (numba, numpy, maybe torch) only when it runs, so listing the
subcommands stays cheap. Add a kind by adding an entry.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ddiloco.cli import user_input
from ddiloco.errors import UserError

_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30}


@dataclass(frozen=True)
class BenchKind:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def parse_count(text: str) -> int:
    """A positive count, optionally with a binary suffix: 4096, 64K, 64M (64 * 2**20), 1G."""
    cleaned = text.strip().upper().replace("_", "")
    factor = _SUFFIXES.get(cleaned[-1:], 1)
    digits = cleaned[:-1] if factor > 1 else cleaned
    if not digits.isdigit() or int(digits) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive count such as 4096, 64K or 64M, got {text!r}")
    return int(digits) * factor


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _write_json(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=2) + "\n")


# ---- merge ----


def _merge_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--elements", type=parse_count, default="64M", help="float32 values per vector (default 64M = 64 * 2**20)"
    )
    p.add_argument("--repeat", type=_positive_int, default=5, help="timed runs per kernel, best kept (default 5)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results as a JSON list")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison even if torch is installed")


def _merge_run(args: argparse.Namespace) -> int:
    from ddiloco.bench import merge

    with user_input():
        config = merge.MergeBenchConfig(
            elements=args.elements, repeat=args.repeat, seed=args.seed, torch=not args.no_torch
        )
    print(f"bench merge: {config}", file=sys.stderr)
    timings = merge.run_merge_bench(config, progress=lambda name: print(f"  timing {name}", file=sys.stderr))
    print(merge.format_table(timings, config))
    if args.json is not None:
        _write_json(args.json, merge.timings_json(timings))
    return 0


# ---- syncer ----


def _syncer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--learners", type=_positive_int, default=8, help="learner processes (default 8)")
    p.add_argument("--params", type=parse_count, default="50000000", help="model parameters (default 50M = 5e7)")
    p.add_argument("--codec", default="int4", choices=["int4", "bf16", "fp32", "int2", "int1"])
    p.add_argument("--fragments", type=_positive_int, default=8)
    p.add_argument("--seconds", type=float, default=20.0, help="how long the learners push (default 20)")
    p.add_argument("--broadcast-codec", default="int4", choices=["int4", "bf16", "fp32"])
    p.add_argument("--merge", default="rda", choices=["rda", "mean"])
    p.add_argument(
        "--quorum",
        type=_positive_int,
        default=1,
        help="the syncer's minimum quorum K (default 1, the syncer's own default): pushes per merge, "
        "and so bytes out per byte in",
    )
    p.add_argument(
        "--shards",
        type=_positive_int,
        help="run the load against 1 syncer and then against this many shards, each a process, side by side",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the result as JSON")


def _syncer_run(args: argparse.Namespace) -> int:
    from ddiloco.bench import syncer

    with user_input():
        config = syncer.SyncerBenchConfig(
            learners=args.learners,
            params=args.params,
            codec=args.codec,
            fragments=args.fragments,
            seconds=args.seconds,
            broadcast_codec=args.broadcast_codec,
            merge=args.merge,
            quorum=args.quorum,
        )
        if args.shards is not None:
            syncer.check_bench_shards(config, args.shards)
    print(f"bench syncer: {config}", file=sys.stderr)
    if args.shards is not None:
        result = syncer.run_sharded_bench(config, args.shards)
        print(syncer.format_shards_report(result))
    else:
        result = syncer.run_syncer_bench(config)
        print(syncer.format_report(result))
    if args.json is not None:
        _write_json(args.json, [result])
    return 0


# ---- learner ----


_SYNTHETIC_STEPS = 1200  # the synthetic loop's default timed steps each way: its steps are short


def _learner_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--steps", type=_positive_int, help="timed steps each way (default 240; 1200 with --synthetic-step-ms)"
    )
    p.add_argument(
        "--rounds",
        type=_positive_int,
        default=20,
        help="alternating blocks each way; the overhead is the median over them (default 20)",
    )
    p.add_argument("--fragments", type=_positive_int, default=4, help="fragments of the syncer (default 4)")
    p.add_argument(
        "--period", type=_positive_int, default=24, help="H, steps between two syncs of a fragment (default 24)"
    )
    p.add_argument("--codec", default="int4", choices=["int4", "bf16", "fp32", "int2", "int1"])
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the result as JSON (a list of one record)")
    ref = p.add_argument_group("the reference loop (the default)")
    ref.add_argument("--batch", type=_positive_int, help="batch of the reference loop (default 8)")
    ref.add_argument("--model", choices=["dense", "moe"], help="dense (default) or moe")
    ref.add_argument(
        "--d-model", type=_positive_int, help="width of the reference model (default 128; a multiple of 4)"
    )
    ref.add_argument("--layers", type=_positive_int, help="layers of the reference model (default 2)")
    syn = p.add_argument_group("the synthetic loop: no model, a pytree perturbed each step and a fixed step time")
    syn.add_argument("--synthetic-step-ms", type=float, metavar="X", help="run the synthetic loop, each step X ms long")
    syn.add_argument(
        "--params", type=parse_count, help="parameters of the synthetic loop's pytree (default 10M = 10 * 2**20)"
    )
    syn.add_argument(
        "--synthetic-wait",
        choices=["sleep", "spin"],
        help="how a synthetic step waits out its time: sleep (default; a host waiting on its accelerator) "
        "or spin (a CPU-bound step)",
    )


def _learner_config(args: argparse.Namespace):
    """The LearnerBenchConfig the flags describe; a flag of the other loop is a UserError."""
    from ddiloco.bench import learner

    synthetic = args.synthetic_step_ms is not None
    other = (
        [
            f
            for f, v in (
                ("--batch", args.batch),
                ("--model", args.model),
                ("--d-model", args.d_model),
                ("--layers", args.layers),
            )
            if v is not None
        ]
        if synthetic
        else [f for f, v in (("--params", args.params), ("--synthetic-wait", args.synthetic_wait)) if v is not None]
    )
    if other:
        loop = "the reference loop" if synthetic else "the synthetic loop (--synthetic-step-ms)"
        raise UserError(f"{', '.join(other)} sizes {loop}, not the one asked for")
    fields = {
        "steps": args.steps or (_SYNTHETIC_STEPS if synthetic else learner.LearnerBenchConfig.steps),
        "rounds": args.rounds,
        "fragments": args.fragments,
        "period": args.period,
        "overlap": args.period // 3,  # tau: a third of H, the default's 8 of 24
        "codec": args.codec,
    }
    for name in ("batch", "model", "d_model", "layers", "synthetic_step_ms", "params", "synthetic_wait"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    with user_input():
        return learner.LearnerBenchConfig(**fields)


def _learner_run(args: argparse.Namespace) -> int:
    from ddiloco.cli import require_learner_extra

    require_learner_extra()
    from ddiloco.bench import learner

    config = _learner_config(args)
    print(f"bench learner: {config}", file=sys.stderr)
    result = learner.run_learner_bench(config)
    print(learner.format_report(result))
    if args.json is not None:
        _write_json(args.json, [result])
    return 0


# ---- sync ----


def _sync_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=parse_count, default="50000000", help="model parameters (default 50M = 5e7)")
    p.add_argument("--learners", type=_positive_int, default=4, help="learner processes, and gloo ranks (default 4)")
    p.add_argument("--codec", default="int4", choices=["int4", "bf16", "fp32", "int2", "int1"], help="push codec")
    p.add_argument("--broadcast-codec", default="int4", choices=["int4", "bf16", "fp32"])
    p.add_argument("--merge", default="mean", choices=["mean", "rda"], help="mean: what an all-reduce computes")
    p.add_argument(
        "--fragments",
        type=_positive_int,
        default=1,
        help="the model cut into this many fragments, pushed in turn and each merged once all its pushes are in, "
        "so that the merge and broadcast of one overlap the encode of the next (default 1: one fragment, "
        "every phase after the one before)",
    )
    p.add_argument("--repeat", type=_positive_int, default=7, help="timed syncs each way, median kept (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="syncs before the timed ones, each way (default 2)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the result as a JSON object")
    p.add_argument("--no-torch", action="store_true", help="skip the gloo comparison even if torch is installed")
    p.add_argument(
        "--no-lane", action="store_true", help="every byte over the websockets, none over the syncer's lane (net.lane)"
    )
    p.add_argument("--seed", type=int, default=0)


def _sync_run(args: argparse.Namespace) -> int:
    from ddiloco.bench import sync

    with user_input():
        config = sync.SyncBenchConfig(
            params=args.params,
            learners=args.learners,
            codec=args.codec,
            broadcast_codec=args.broadcast_codec,
            merge=args.merge,
            fragments=args.fragments,
            repeat=args.repeat,
            warmup=args.warmup,
            torch=not args.no_torch,
            lane=not args.no_lane,
            seed=args.seed,
        )
    print(f"bench sync: {config}", file=sys.stderr)
    result = sync.run_sync_bench(config, progress=lambda text: print(f"  {text}", file=sys.stderr))
    print(sync.format_report(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


KINDS: dict[str, BenchKind] = {
    "learner": BenchKind(
        "step time of the reference training loop with the sync hook against without it",
        _learner_arguments,
        _learner_run,
    ),
    "syncer": BenchKind(
        "ingest of the real daemon with spawned learner processes over loopback", _syncer_arguments, _syncer_run
    ),
    "sync": BenchKind(
        "one full outer sync (M learners, the real syncer) against a torch gloo all-reduce", _sync_arguments, _sync_run
    ),
    "merge": BenchKind(
        "throughput of the merge kernels against numpy, torch and memory bandwidth", _merge_arguments, _merge_run
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    for name, kind in KINDS.items():
        p = sub.add_parser(name, help=kind.help, description=kind.help)
        kind.add_arguments(p)
        p.set_defaults(_bench=kind)


def run(args: argparse.Namespace) -> int:
    return args._bench.run(args)
