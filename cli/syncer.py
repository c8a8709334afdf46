"""`ddiloco syncer`: run the syncer daemon.

Flags map one-to-one onto `SyncerConfig` and `ServerConfig`; a `--config FILE.toml` supplies the
same keys (flags given on the command line win over the file, nothing else overrides either). The
resolved configuration is the first line of the log.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tomllib
from pathlib import Path

from ddiloco.cli import user_input
from ddiloco.errors import UserError

# flag -> config key, for the SyncerConfig fields that are set from the command line
_CORE_FLAGS = {
    "fragments": "num_fragments",
    "period": "period",
    "strategy": "strategy",
    "block": "block",
    "quorum": "quorum",
    "merge": "merge",
    "broadcast_codec": "broadcast_codec",
    "learners_max": "learners_max",
    "checkpoint_every_merges": "checkpoint_every_merges",
    "checkpoint_every_s": "checkpoint_every_s",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8470, help="port (0 picks a free one; default 8470)")
    p.add_argument("--config", type=Path, help="TOML file with syncer config keys")
    p.add_argument("--init", type=Path, help="initial parameters (a checkpoint file written by the learner side)")
    p.add_argument("--checkpoint-dir", type=Path, help="where checkpoints are written")
    p.add_argument("--resume", type=Path, help="continue from the newest valid checkpoint in this directory")
    p.add_argument("--auth-token-file", type=Path, help="file holding the shared bearer token")
    p.add_argument("--fragments", type=int, help="P, number of fragments (default 4)")
    p.add_argument("--period", type=int, help="H, steps between two syncs of one fragment (default 4)")
    p.add_argument("--strategy", choices=["layer", "tensor", "balanced"])
    p.add_argument("--block", type=int, help="values per int4 scale (default 128)")
    p.add_argument("--quorum", type=int, help="K, minimum learners per merge (default 1)")
    p.add_argument("--grace-max-ms", type=float, help="cap of the adaptive grace window (default 1000)")
    p.add_argument("--grace-gamma", type=float, help="share of the slack spent waiting (default 0.5)")
    p.add_argument("--overlap", type=int, help="tau, steps a fragment may stay in flight (default 2)")
    p.add_argument("--outer-lr", type=float, help="outer Nesterov learning rate (default 0.7)")
    p.add_argument("--outer-momentum", type=float, help="outer Nesterov momentum (default 0.9)")
    p.add_argument("--merge", choices=["rda", "mean"])
    p.add_argument("--broadcast-codec", choices=["fp32", "bf16"])
    p.add_argument("--learners-max", type=int)
    p.add_argument("--checkpoint-every-merges", type=int)
    p.add_argument("--checkpoint-every-s", type=float)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    p.add_argument("--record", type=Path, metavar="DIR",
                   help="write the event tape of this run into DIR (a new directory; `ddiloco replay DIR` checks it)")
    p.add_argument("--snapshot-dir", type=Path, metavar="DIR",
                   help="where consistent snapshots (syncer + learners + messages in flight) go; "
                        "taken by POST /snapshot or `ddiloco snapshot URL`")
    p.add_argument("--snapshot-every-s", type=float, default=0.0, help="also take a snapshot every this many seconds")
    p.add_argument("--snapshot-wait-s", type=float, default=120.0,
                   help="how long a snapshot waits for the learners' local states (default 120)")
    p.add_argument("--record-no-payloads", action="store_true",
                   help="with --record: keep only the hashes of pushed payloads (a smaller tape that cannot be replayed)")


def resolve_config(args: argparse.Namespace):
    """The SyncerConfig from the TOML file and the flags (flags win)."""
    from ddiloco.core.config import from_mapping

    values: dict = {}
    if args.config is not None:
        try:
            values = tomllib.loads(args.config.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise UserError(f"cannot read config file {args.config}: {exc}") from exc
        values = dict(values.get("syncer", values))
    for flag, key in _CORE_FLAGS.items():
        if getattr(args, flag) is not None:
            values[key] = getattr(args, flag)
    outer = dict(values.get("outer", {}))
    if args.outer_lr is not None:
        outer["lr"] = args.outer_lr
    if args.outer_momentum is not None:
        outer["momentum"] = args.outer_momentum
    if outer:
        values["outer"] = outer
    grace = dict(values.get("grace", {}))
    for flag, key in (("grace_max_ms", "grace_ms_max"), ("grace_gamma", "gamma"), ("overlap", "overlap")):
        if getattr(args, flag) is not None:
            grace[key] = getattr(args, flag)
    if grace:
        values["grace"] = grace
    return from_mapping(values)


def run(args: argparse.Namespace) -> int:
    import orjson

    from ddiloco import kernels
    from ddiloco.core import checkpoint, syncer
    from ddiloco.net import server, store
    from ddiloco.net.auth import read_token_file

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    log = logging.getLogger("ddiloco.syncer")
    if args.resume is not None and args.init is not None:
        raise UserError("--resume and --init exclude each other: a resumed syncer already holds parameters")
    if args.resume is not None:
        try:
            state, path = store.newest_valid(args.resume)
        except store.StoreError as exc:
            raise UserError(f"cannot resume: {exc}") from exc
        config = state.config
        log.info("config %s", orjson.dumps({"resumed_from": str(path), **config.to_dict()}).decode())
        log.info("resumed from %s: %d merges, global step %d", path.name, state.merges, state.global_step)
    else:
        config = resolve_config(args)
        log.info("config %s", orjson.dumps(config.to_dict()).decode())
        if args.init is not None:
            try:
                initial = checkpoint.restore(args.init.read_bytes())
            except OSError as exc:
                raise UserError(f"cannot read --init {args.init}: {exc.strerror}") from exc
            with user_input():  # parameters that do not fit the configuration
                state = syncer.new_state(config, initial.layout, [f.theta for f in initial.fragments])
            log.info("initial parameters from %s (layout %s)", args.init, state.layout.digest[:12])
        else:
            state = syncer.new_state(config)
            log.info("no --init: version 0 will come from the first learner's hello")
    token = read_token_file(args.auth_token_file) if args.auth_token_file else None
    if token is None:
        log.warning("no --auth-token-file: any peer that reaches the port may join")
    kernels.warmup()
    with user_input():  # ServerConfig checks the values the flags gave
        server_config = server.ServerConfig(
            host=args.host, port=args.port, auth_token=token, checkpoint_dir=args.checkpoint_dir or args.resume,
            snapshot_dir=args.snapshot_dir, snapshot_every_s=args.snapshot_every_s, snapshot_wait_s_max=args.snapshot_wait_s,
        )
    tape = _open_tape(args, state, log)
    daemon = server.SyncerServer(state, server_config, tape=tape)
    server.use_uvloop()
    asyncio.run(daemon.serve_forever())
    return 0


def _open_tape(args: argparse.Namespace, state, log: logging.Logger):
    """The tape writer for --record, started from the state the daemon is about to serve."""
    from ddiloco.core import tape as tapes

    if args.record is None:
        if args.record_no_payloads:
            raise UserError("--record-no-payloads needs --record DIR")
        return None
    source = f"resume {args.resume}" if args.resume else f"init {args.init}" if args.init else "no parameters"
    options = tapes.TapeOptions(keep_payloads=not args.record_no_payloads)
    writer = tapes.TapeWriter.create(args.record, state, source, options)  # a TapeError is a UserError
    log.info("recording the event tape in %s (payloads %s)", args.record, "kept" if options.keep_payloads else "hashed only")
    return writer


