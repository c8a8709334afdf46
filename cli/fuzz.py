"""`ddiloco fuzz`: fuzz a real syncer daemon over its websocket (net.fuzz).

    ddiloco fuzz --seconds 60 --seed 7 [--frames N] [--json PATH]

Starts a daemon on 127.0.0.1, honest learners that train and merge, and hostile peers that send
mutated frames of every kind; checks after every batch that the core lives, the global state never
moves backwards, nothing non-finite is broadcast and memory stays bounded. Prints frames sent,
errors answered, core deaths and the checks; the exit status is 1 on any failure. The seed derives
every mutation: run it again to reproduce a failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=30.0, help="how long to fuzz (default 30)")
    p.add_argument("--seed", type=int, default=0, help="derives every mutation (default 0)")
    p.add_argument("--frames", type=int, default=0, help="stop after this many fuzzed frames (default: no limit)")
    p.add_argument("--batch", type=int, default=200, help="fuzzed messages between two checks (default 200)")
    p.add_argument("--hostile-peers", type=int, default=3, help="hostile connections at once (default 3)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON")
    p.add_argument(
        "--log-level",
        default="error",
        choices=["info", "warning", "error"],
        help="the daemon's log (default error: every refusal is a warning)",
    )


def run(args: argparse.Namespace) -> int:
    from ddiloco.net import fuzz

    config = fuzz.FuzzConfig(
        seconds=args.seconds,
        seed=args.seed,
        frames_max=args.frames,
        batch_frames=args.batch,
        hostile_peers=args.hostile_peers,
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    report = fuzz.run(config)
    for line in report.lines():
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    return 0 if report.ok else 1
