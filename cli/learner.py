"""`ddiloco learner`: run one learner of the reference model against a syncer."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ddiloco.cli import user_input
from ddiloco.errors import UserError

if TYPE_CHECKING:  # the learner extra (jax) is imported only when a learner runs
    from ddiloco.demo.learner_process import LearnerConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--syncer",
        required=True,
        metavar="URL[,URL...]",
        help="the syncer's websocket URL, e.g. ws://127.0.0.1:8470/ws; for a syncer split into shards, "
        "every shard's URL separated by commas (in any order)",
    )
    p.add_argument("--token-file", type=Path, help="file holding the shared bearer token")
    p.add_argument(
        "--tls-ca",
        type=Path,
        metavar="FILE",
        help="with a wss:// syncer: trust only the CA certificate(s) in this PEM file (default: the system's)",
    )
    p.add_argument(
        "--no-lane",
        action="store_true",
        help="send and receive every byte over the websocket, never over the syncer's lane",
    )
    p.add_argument("--model", choices=["dense", "moe"], default="dense")
    p.add_argument("--shard", default="0/1", help="I/N: this learner's share of the training data")
    p.add_argument("--name", help="learner name in the syncer's status (default: learner-I)")
    p.add_argument(
        "--steps",
        type=int,
        default=200,
        help="steps this learner trains (default 200), its own: a learner that joins late, after "
        "the others have spent theirs, still trains this many (the syncer's global step, which "
        "it continues, does not count against them)",
    )
    p.add_argument(
        "--schedule-steps",
        type=int,
        help="length of the learning-rate schedule in steps (default: --steps); past it the rate stays at its floor",
    )
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codec", default="int4", choices=["int4", "bf16", "fp32", "int2", "int1"])
    p.add_argument("--speed", type=float, default=1.0, help="< 1 makes this learner slower")
    p.add_argument("--log-file", type=Path, help="append JSON lines of progress here")
    p.add_argument("--cache-dir", type=Path, help="JAX persistent compilation cache")
    p.add_argument("--record", type=Path, metavar="DIR", help="write this learner's tape to DIR (a new directory)")
    p.add_argument(
        "--restore",
        type=Path,
        metavar="FILE",
        help="continue from this learner's local state in a consistent snapshot (learner-<id>.ddls)",
    )
    p.add_argument(
        "--devices",
        metavar="SPEC",
        help="the JAX devices this process uses: all (default: what JAX finds), cpu, or GPU indices "
        "such as 0 or 0,1 (counted within CUDA_VISIBLE_DEVICES where that is set)",
    )
    p.add_argument(
        "--memory-fraction",
        type=float,
        metavar="F",
        help="learners sharing a GPU: no preallocation, and at most this share of its memory each "
        "(e.g. 0.42 for two; without it JAX takes 75%% of the GPU in the first process)",
    )
    # One learner over several processes (hosts): every process runs this command with the same
    # flags but its own --process-id; process 0 talks to the syncer (learner/multihost.py).
    p.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="spread this learner over several JAX processes: process 0's address for jax.distributed "
        "(the same on every process; process 0 listens on PORT)",
    )
    p.add_argument("--num-processes", type=int, default=1, help="with --coordinator: the learner's processes")
    p.add_argument("--process-id", type=int, default=0, help="with --coordinator: this process's index, 0 to N-1")


def run(args: argparse.Namespace) -> int:
    from ddiloco.cli import require_learner_extra

    require_learner_extra()
    # First of all: the devices are fixed once JAX's backend starts (learner.devices).
    from ddiloco.learner import devices

    spec = devices.parse_devices(args.devices) if args.devices is not None else None
    if spec is not None or args.memory_fraction is not None:
        devices.apply_devices(spec or devices.DeviceSpec("all"), args.memory_fraction)
    from ddiloco.demo.learner_process import run_learner

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.coordinator is not None:
        return _run_multiprocess(args)
    if args.num_processes != 1 or args.process_id != 0:
        raise UserError("--num-processes and --process-id need --coordinator (process 0's HOST:PORT)")
    if spec is not None:
        logging.getLogger("ddiloco.learner").info("devices %s: %s", spec, devices.check_devices(spec))
    cfg = _learner_config(args, speed=args.speed, record=args.record, restore=args.restore)
    from ddiloco.core.tape import TapeError
    from ddiloco.net.client import SyncerRefused

    try:
        summary = run_learner(cfg)
    except (
        SyncerRefused,
        TimeoutError,
        TapeError,
    ) as exc:  # wrong URL or token, a layout or protocol refused, --record
        print(f"ddiloco learner: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


def _run_multiprocess(args: argparse.Namespace) -> int:
    """This process's part of one learner over --num-processes processes (learner/multihost.py)."""
    from ddiloco.demo.multiprocess_learner import ProcessSetup, run_multiprocess_learner
    from ddiloco.learner.multihost import LearnerProcessLost, check_process_args, exit_lost, initialize_processes
    from ddiloco.net.client import SyncerRefused

    if args.record is not None or args.restore is not None:
        raise UserError("--record and --restore are for a learner of one process (not with --coordinator)")
    if args.speed != 1.0:
        raise UserError("--speed is for a learner of one process (not with --coordinator)")
    check_process_args(args.coordinator, args.num_processes, args.process_id)
    cfg = _learner_config(args, peer=None)
    setup = ProcessSetup(args.coordinator, args.num_processes, args.process_id)
    initialize_processes(setup.coordinator, setup.num_processes, setup.process_id)
    try:
        summary = run_multiprocess_learner(cfg, setup)
    except LearnerProcessLost as exc:
        exit_lost(exc)  # never returns: the interpreter's exit would wait for the dead process
    except (SyncerRefused, TimeoutError) as exc:
        # Only process 0 talks to the syncer. It leaves at once (os._exit, not the interpreter's
        # exit, which would wait in jax.distributed's shutdown barrier for the others); the
        # others see it gone (LearnerProcessLost) and leave too.
        print(f"ddiloco learner: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    print(json.dumps(summary), flush=True)
    return 0


def _learner_config(args: argparse.Namespace, **only_some: object) -> LearnerConfig:
    """The learner's settings from the flags both kinds of learner share; `only_some`: the rest."""
    from ddiloco.demo.learner_process import LearnerConfig
    from ddiloco.net.auth import read_token_file
    from ddiloco.net.sharded import split_urls
    from ddiloco.reference import data, model

    shard = data.Shard.parse(args.shard)
    with user_input():  # the configs check the values the flags gave
        return LearnerConfig(
            syncer=",".join(split_urls(args.syncer)),  # a bad list of shard URLs is refused before JAX compiles
            name=args.name or f"learner-{shard.index}",
            shard=shard,
            # The syncer is where a shared token file is refused; a learner reading one only warns.
            token=read_token_file(args.token_file, allow_shared=True) if args.token_file else None,
            ca_file=args.tls_ca,
            lane=not args.no_lane,
            model=model.ModelConfig(experts=4 if args.model == "moe" else 0),
            train=model.TrainConfig(total_steps=max(args.schedule_steps or args.steps, 21)),
            batch=args.batch,
            seed=args.seed,
            codec=args.codec,
            steps_total=args.steps,
            log_file=args.log_file,
            cache_dir=args.cache_dir,
            **only_some,
        )
