"""`ddiloco demo`: the syncer and M learners on this machine, with chaos, against a DP baseline."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--steps", type=int, help="global step budget (default 400; 60 with --quick)")
    p.add_argument("--quick", action="store_true", help="a short run (about half a minute of training)")
    p.add_argument("--no-chaos", action="store_true", help="no kills and no pauses")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--speeds", help="comma-separated relative speeds, e.g. 1,1,0.7,0.7")
    p.add_argument("--baseline", choices=["dp", "none"], default="dp")
    p.add_argument("--model", choices=["dense", "moe"], default="dense")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, help="where logs and checkpoints go (default: a new temp dir)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the report as JSON")


def run(args: argparse.Namespace) -> int:
    from ddiloco.cli import require_learner_extra

    require_learner_extra()
    from ddiloco.learner.demo import DemoConfig, report_json, report_text, run_demo

    speeds = tuple(float(s) for s in args.speeds.split(",")) if args.speeds else ()
    steps = args.steps or (60 if args.quick else 400)
    cfg = DemoConfig(
        learners=args.learners, steps=steps, chaos=not args.no_chaos, kills=(1 if args.quick else args.kills),
        pauses=1 if args.quick else 2, speeds=speeds, baseline=args.baseline == "dp", seed=args.seed, model=args.model,
        restart_delay_s=1.0 if args.quick else 3.0, pause_s=1.0 if args.quick else 3.0,
        # a short run needs more frequent syncs to show merging at all
        period=8 if args.quick else 24, overlap=4 if args.quick else 8,
    )
    print(f"demo: {cfg}", file=sys.stderr)
    report = run_demo(cfg, args.workdir)
    print(report_text(report))
    if args.json:
        args.json.write_text(json.dumps(report_json(report), indent=2) + "\n")
    return 0
