"""`ddiloco demo`: the syncer and M learners on this machine, with chaos, against a DP baseline."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from ddiloco.cli import user_input
from ddiloco.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--learners", type=int, default=4)
    p.add_argument(
        "--steps",
        type=int,
        help="the budget in data-parallel steps: the learners train steps x learners x batch x 64 tokens in all, in up to 2 x steps global steps (default 400; 60 with --quick)",
    )
    p.add_argument("--quick", action="store_true", help="a short run (about half a minute of training)")
    p.add_argument("--no-chaos", action="store_true", help="no kills and no pauses")
    p.add_argument("--kills", type=int, default=3, help="learner kills (default 3; 1 with --quick)")
    p.add_argument("--pauses", type=int, help="learner pauses (default 2; 1 with --quick)")
    p.add_argument(
        "--kill-syncer",
        action="store_true",
        help="also kill the syncer once; a hot standby takes over from its checkpoint",
    )
    p.add_argument(
        "--cold-restart",
        action="store_true",
        help="with --kill-syncer: no standby; start a new syncer process from the checkpoint after the kill",
    )
    p.add_argument("--speeds", help="comma-separated relative speeds in (0, 1], e.g. 1,1,0.7,0.7")
    p.add_argument(
        "--baseline", choices=["dp", "none"], default="dp", help="train a data-parallel baseline (default dp)"
    )
    p.add_argument("--model", choices=["dense", "moe"], default="dense")
    p.add_argument("--batch", type=int, default=8, help="per-learner batch (default 8)")
    p.add_argument("--period", type=int, help="H, steps between two syncs of one fragment (default 12; 8 with --quick)")
    p.add_argument("--overlap", type=int, help="tau, steps a fragment may stay in flight (default 4)")
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--quorum", type=int, default=1, help="K, minimum learners per merge")
    p.add_argument("--outer-lr", type=float, default=1.0, help="outer learning rate (default 1.0: plain averaging)")
    p.add_argument("--outer-momentum", type=float, default=0.0, help="outer Nesterov momentum (default 0)")
    p.add_argument(
        "--merge", choices=["rda", "mean"], default="rda", help="how the syncer merges outer gradients (default rda)"
    )
    p.add_argument("--grace-max-ms", type=float, default=1000.0, help="cap of the adaptive grace window")
    p.add_argument(
        "--grace-gamma", type=float, default=0.5, help="share of the slack the grace window waits (default 0.5)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, help="where logs and checkpoints go (default: a new temp dir)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the report as JSON")
    p.add_argument(
        "--snapshot-every-s",
        type=float,
        default=0.0,
        help="take a consistent snapshot (syncer + learners + messages in flight) every this many seconds "
        "into <workdir>/snapshots (also on `ddiloco snapshot URL`)",
    )
    p.add_argument(
        "--restore",
        type=Path,
        metavar="SNAPSHOT_DIR",
        help="restart the whole system from a snapshot and train on to the token budget",
    )
    p.add_argument(
        "--record",
        type=Path,
        metavar="DIR",
        help="record the whole run (syncer and learners) for `ddiloco replay DIR --full`",
    )
    p.add_argument(
        "--gpus",
        type=int,
        help="GPUs to share out among the learners: each its own where there are enough, else round robin "
        "with a memory cap per learner; 0: none (default: as many as nvidia-smi lists)",
    )
    p.add_argument("--plot", type=Path, metavar="PATH", help="write a PNG of loss against tokens, kills marked")


def _speeds(text: str | None) -> tuple[float, ...]:
    if not text:
        return ()
    try:
        return tuple(float(s) for s in text.split(","))
    except ValueError:
        raise UserError(f"--speeds must be comma-separated numbers such as 1,1,0.7,0.7, got {text!r}") from None


def config_from_args(args: argparse.Namespace):
    """The DemoConfig the flags describe (`--quick` only changes defaults a flag did not set)."""
    from ddiloco.demo.config import DemoConfig

    quick, full = args.quick, DemoConfig  # the dataclass's defaults are the full demo's
    with user_input():  # DemoConfig checks the values the flags gave
        cfg = DemoConfig(
            learners=args.learners,
            steps=args.steps or (60 if quick else full.steps),
            batch=args.batch,
            fragments=args.fragments,
            quorum=args.quorum,
            chaos=not args.no_chaos,
            kills=1 if quick and args.kills == 3 else args.kills,
            pauses=args.pauses if args.pauses is not None else (1 if quick else 2),
            kill_syncer=args.kill_syncer,
            syncer_standby=not args.cold_restart,
            speeds=_speeds(args.speeds),
            baseline=args.baseline == "dp",
            seed=args.seed,
            model=args.model,
            restart_delay_s=1.0 if quick else full.restart_delay_s,
            pause_s=1.0 if quick else full.pause_s,
            # a short run needs more frequent syncs to show merging at all
            period=args.period or (8 if quick else full.period),
            overlap=args.overlap or full.overlap,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            merge=args.merge,
            grace_ms_max=args.grace_max_ms,
            grace_gamma=args.grace_gamma,
            record=args.record,
            snapshot_every_s=args.snapshot_every_s,
            restore=args.restore,
            gpus=args.gpus,
        )
    return cfg


def run(args: argparse.Namespace) -> int:
    from ddiloco.cli import MissingExtraError, require_learner_extra

    require_learner_extra()
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # say so before minutes of training
        raise MissingExtraError(
            "--plot needs matplotlib: install the learner extra, e.g. `pip install 'ddiloco[learner]'`"
        )
    from ddiloco.demo.plot import write_plot
    from ddiloco.demo.report import report_json, report_text
    from ddiloco.demo.supervisor import run_demo

    cfg = config_from_args(args)
    print(f"demo: {cfg}", file=sys.stderr)
    report = run_demo(cfg, args.workdir)
    print(report_text(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report_json(report), indent=2) + "\n")
    if args.plot:
        write_plot(report, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
