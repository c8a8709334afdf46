"""`ddiloco syncer`: run the syncer daemon.

Every setting is declared once, in `SETTINGS`: it is a flag (`--auth-token-file`), an environment
variable (`DDILOCO_AUTH_TOKEN_FILE`) and a key of the `--config` TOML file (`auth_token_file`), and
flags win over variables, variables over the file, the file over the defaults (`cli.settings`). The
first line of the log is the effective configuration and where each value that is not a default
came from.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Self

import orjson

from ddiloco.cli import user_input
from ddiloco.cli.settings import (
    Resolved,
    Setting,
    SettingsError,
    add_flags,
    config_location,
    read_config_text,
    resolve,
)
from ddiloco.errors import UserError

_CODECS = ("int4", "bf16", "fp32")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
STANDBY_POLL_S = 0.5  # how often a standby looks for the run's first checkpoint

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "config",
        Path,
        "TOML file whose keys are these flags' names with underscores (auth_token_file = ...)",
        in_file=False,
        metavar="FILE",
    ),
    Setting("host", str, "address to listen on", default="127.0.0.1"),
    Setting("port", int, "port (0 picks a free one)", default=8470, bounds=(0, 65535)),
    Setting(
        "lane-port",
        int,
        "port of the lane, the TCP connection beside each websocket that carries pushes' and updates'"
        " bytes, with TLS where the syncer serves it (0 picks a free one; learners ask GET /lane)",
        default=0,
        bounds=(0, 65535),
    ),
    Setting("no-lane", bool, "no lane: every byte goes over the websockets", default=False),
    Setting("auth-token-file", Path, "file holding the shared bearer token (mode 0600)", metavar="FILE"),
    Setting(
        "allow-shared-token", bool, "accept a token file that group or others may read (with a warning)", default=False
    ),
    Setting(
        "tls-cert", Path, "PEM certificate (chain) to serve https:// and wss:// with; needs tls-key", metavar="FILE"
    ),
    Setting("tls-key", Path, "PEM private key of tls-cert (keep it mode 0600)", metavar="FILE"),
    Setting("insecure-no-auth", bool, "serve without a token on an address other machines can reach", default=False),
    Setting("checkpoint-dir", Path, "where checkpoints are written", metavar="DIR"),
    Setting("init", Path, "initial parameters (a checkpoint file written by the learner side)", metavar="FILE"),
    Setting("resume", Path, "continue from the newest valid checkpoint in this directory", metavar="DIR"),
    Setting(
        "overwrite",
        bool,
        "start a new run in a checkpoint-dir that holds another run's checkpoints "
        "(they are deleted once the new run's first checkpoint is written)",
        default=False,
    ),
    Setting("fragments", int, "P, number of fragments (default 4)"),
    Setting(
        "shard",
        int,
        "this syncer is shard SHARD of SHARDS and owns fragments p with p mod SHARDS == SHARD (default 0); "
        "each shard runs as its own process with its own checkpoint directory",
    ),
    Setting("shards", int, "number of syncer shards the fragments are split among (default 1: not sharded)"),
    Setting("period", int, "H, steps between two syncs of one fragment (default 4)"),
    Setting(
        "strategy",
        str,
        "how tensors are grouped into fragments (default balanced)",
        choices=("layer", "tensor", "balanced"),
    ),
    Setting("block", int, "values per int4 scale (default 128)"),
    Setting("quorum", int, "K, minimum learners per merge (default 1)"),
    Setting("grace-max-ms", float, "cap of the adaptive grace window (default 1000)"),
    Setting("grace-gamma", float, "share of the slack spent waiting (default 0.5)"),
    Setting("overlap", int, "tau, steps a fragment may stay in flight (default 2)"),
    Setting("outer-lr", float, "outer Nesterov learning rate (default 0.7)"),
    Setting("outer-momentum", float, "outer Nesterov momentum (default 0.9)"),
    Setting("merge", str, "how pushed outer gradients are merged (default rda)", choices=("rda", "mean")),
    Setting(
        "broadcast-codec",
        str,
        "codec of the deltas of the merged fragments sent to learners (default int4)",
        choices=_CODECS,
    ),
    Setting("learners-max", int, "learners connected at once (default 256)"),
    Setting(
        "checkpoint-every-merges", int, "also write a checkpoint every this many merges (default 0: never by count)"
    ),
    Setting("checkpoint-every-s", float, "write a checkpoint every this many seconds (default 300; 0: never by time)"),
    Setting(
        "standby",
        bool,
        "with resume DIR: a hot standby that imports and loads its kernels now, waits until the syncer "
        "holding DIR exits, then resumes from its newest checkpoint and serves in its place",
        default=False,
    ),
    Setting("log-level", str, "log level", default="info", choices=("debug", "info", "warning")),
    Setting(
        "record",
        Path,
        "write the event tape of this run into DIR (a new directory; `ddiloco replay DIR` checks it)",
        metavar="DIR",
    ),
    Setting(
        "record-no-payloads",
        bool,
        "with --record: keep only the hashes of pushed payloads (a smaller tape that cannot be replayed)",
        default=False,
    ),
    Setting(
        "snapshot-dir",
        Path,
        "where consistent snapshots (syncer + learners + messages in flight) go; "
        "taken by POST /snapshot or `ddiloco snapshot URL`",
        metavar="DIR",
    ),
    Setting(
        "snapshot-every-s",
        float,
        "also take a snapshot every this many seconds (0: never)",
        default=0.0,
        bounds=(0.0, 1e9),
    ),
    Setting(
        "snapshot-wait-s",
        float,
        "how long a snapshot waits for the learners' local states",
        default=120.0,
        bounds=(0.0, 1e9),
    ),
)

# setting -> where it goes in the core's SyncerConfig (core.config.from_mapping; "table.key" is nested)
CORE_KEYS = {
    "fragments": "num_fragments",
    "shard": "shard",
    "shards": "shards",
    "period": "period",
    "strategy": "strategy",
    "block": "block",
    "quorum": "quorum",
    "merge": "merge",
    "broadcast_codec": "broadcast_codec",
    "learners_max": "learners_max",
    "checkpoint_every_merges": "checkpoint_every_merges",
    "checkpoint_every_s": "checkpoint_every_s",
    "outer_lr": "outer.lr",
    "outer_momentum": "outer.momentum",
    "grace_max_ms": "grace.grace_ms_max",
    "grace_gamma": "grace.gamma",
    "overlap": "grace.overlap",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, SETTINGS)


def resolve_settings(args: argparse.Namespace, environ: dict[str, str]) -> Resolved:
    """The settings from the flags, the `DDILOCO_*` variables and the config file they name."""
    path = config_location(SETTINGS, args, environ)
    text = read_config_text(path) if path is not None else None
    return resolve(SETTINGS, args, environ, config_text=text, config_path=path)


def core_config(settings: Resolved):
    """The core's SyncerConfig from the settings; a bad value is refused naming where it came from."""
    from ddiloco.core.config import ConfigError, from_mapping

    given = {key: settings.values[key] for key in CORE_KEYS if settings.values[key] is not None}
    try:
        return from_mapping(_nested(given))
    except (ConfigError, ValueError) as exc:
        # The core names the field; say which of the user's settings it came from.
        culprits = []
        for key, value in given.items():
            try:
                from_mapping(_nested({key: value}))
            except (ConfigError, ValueError):
                culprits.append(key)
        named = culprits or list(given)
        where = ", ".join(f"{key} from {settings.sources.get(key, 'the defaults')}" for key in named)
        raise SettingsError(f"{exc} ({where})") from None


def effective(settings: Resolved, config: Any, resumed_from: Path | None) -> dict[str, Any]:
    """What the first log line shows: every setting's value in force, and the source of those that are
    not defaults. The core's values are those of `config` (a resumed syncer keeps its checkpoint's)."""
    core = config.to_dict()
    values, sources = {}, dict(settings.sources)
    for s in SETTINGS:
        value = settings.values[s.key]
        if s.key in CORE_KEYS:
            table, _, name = CORE_KEYS[s.key].rpartition(".")
            value = core[table][name] if table else core[name]
            if resumed_from is not None:
                sources[s.key] = f"checkpoint {resumed_from.name}"
        values[s.key] = str(value) if isinstance(value, Path) else value
    return {**values, "sources": sources}


def run(args: argparse.Namespace) -> int:
    import asyncio

    from ddiloco import kernels
    from ddiloco.core import checkpoint, syncer
    from ddiloco.net import ownership, server, store
    from ddiloco.net.auth import check_exposure, read_token_file
    from ddiloco.net.warmup import syncer_warmup

    settings = resolve_settings(args, dict(os.environ))
    v = settings.values
    if v["resume"] is not None and v["init"] is not None:
        raise UserError("resume and init exclude each other: a resumed syncer already holds parameters")
    if v["record_no_payloads"] and v["record"] is None:
        raise UserError("record_no_payloads needs record DIR")
    log = logging.getLogger("ddiloco.syncer")
    kernels.skip_blas_probe()  # this process imports no scipy: numba's first kernel loads faster without it
    written_dir = v["checkpoint_dir"] or v["resume"]
    if v["standby"]:
        if v["resume"] is None or written_dir != v["resume"]:
            raise UserError("standby needs resume DIR (and no other checkpoint-dir): the directory it takes over")
        logging.basicConfig(level=v["log_level"].upper(), format=LOG_FORMAT, stream=sys.stderr)
        lock = _stand_by(v["resume"], log, _shard_of(settings))
    else:
        # One syncer per checkpoint directory: taken before the newest checkpoint is read.
        # (A resume DIR that does not exist is left to the resume's own error.)
        exists = written_dir is not None and (v["checkpoint_dir"] is not None or Path(written_dir).is_dir())
        lock = ownership.DirectoryLock.acquire(written_dir) if exists else None
    # Reading the checkpoint and the token may log (a corrupt checkpoint skipped, a shared token
    # accepted): those lines are held until the configuration has been logged, which comes first.
    with _HeldRecords(v["log_level"]) as held:
        resumed_from = None
        if v["resume"] is not None:
            try:
                state, resumed_from = store.newest_valid(v["resume"])
            except store.StoreError as exc:
                raise UserError(f"cannot resume: {exc}") from exc
            config = state.config
            try:  # the shard is not the checkpoint's to decide: resuming another shard's is refused
                checkpoint.check_resumed_shard(state, *_shard_of(settings))
            except checkpoint.CheckpointError as exc:
                raise UserError(f"cannot resume {resumed_from}: {exc}") from exc
            ignored = sorted(key for key in CORE_KEYS if key in settings.sources and key not in _SHARD_KEYS)
            if ignored:
                log.warning(
                    "resuming keeps the checkpoint's configuration: %s not applied",
                    ", ".join(f"{key} {settings.sources[key]}" for key in ignored),
                )
        else:
            config = core_config(settings)
            state = None
        token = (
            read_token_file(v["auth_token_file"], allow_shared=v["allow_shared_token"])
            if v["auth_token_file"]
            else None
        )
        check_exposure(v["host"], token, v["insecure_no_auth"])
        _check_tls(v)
    logging.basicConfig(level=v["log_level"].upper(), format=LOG_FORMAT, stream=sys.stderr)
    log.info("config %s", orjson.dumps(effective(settings, config, resumed_from)).decode())
    held.replay()
    if state is not None:
        log.info("resumed from %s: %d merges, global step %d", resumed_from.name, state.merges, state.global_step)
    elif v["init"] is not None:
        try:
            initial = checkpoint.restore(Path(v["init"]).read_bytes())
        except OSError as exc:
            raise UserError(f"cannot read init {v['init']}: {exc.strerror}") from exc
        with user_input():  # parameters that do not fit the configuration
            state = syncer.new_state(config, initial.layout, [f.theta for f in initial.fragments])
        log.info("initial parameters from %s (layout %s)", v["init"], state.layout.digest[:12])
    else:
        state = syncer.new_state(config)
        log.info("no init: version 0 will come from the first learner's hello")
    if token is None:
        log.warning("no auth token: any peer that reaches %s:%d may join", v["host"], v["port"])
    with user_input():  # ServerConfig checks the values the settings gave
        server_config = server.ServerConfig(
            host=v["host"],
            port=v["port"],
            lane_port=None if v["no_lane"] else v["lane_port"],
            auth_token=token,
            checkpoint_dir=v["checkpoint_dir"] or v["resume"],
            snapshot_dir=v["snapshot_dir"],
            snapshot_every_s=v["snapshot_every_s"],
            snapshot_wait_s_max=v["snapshot_wait_s"],
            run_id=store.run_of(resumed_from) if resumed_from is not None else None,
            checkpoint_overwrite=v["overwrite"],
            tls_cert=v["tls_cert"],
            tls_key=v["tls_key"],
        )
    try:
        daemon = server.SyncerServer(state, server_config)
    except store.StoreError as exc:
        raise UserError(str(exc)) from exc
    if daemon.checkpoints.store is not None:
        log.info("checkpoints of run %s go to %s", daemon.checkpoints.store.run, daemon.checkpoints.store.directory)
    daemon.tape = _open_tape(v, state, log)
    server.use_uvloop()
    # The kernels load after listening, beside the learners' reconnection: a restart's outage is
    # shorter. (A standby has loaded them, or is loading them, already: then this is quick.)
    try:
        asyncio.run(daemon.serve_forever(warmup=syncer_warmup(state.config, state.layout)))
    finally:
        if lock is not None:
            lock.release()
    # A last checkpoint that failed is an error of the whole run: say so in the exit status too.
    return 0 if daemon.checkpoints.healthy else 1


def _stand_by(directory: Path, log: logging.Logger, shard: tuple[int, int]) -> Any:
    """A hot standby's wait: once the run in `directory` has a checkpoint, load the kernels for it on
    a thread of its own, and meanwhile block until the syncer holding the directory exits; then hold
    it (the returned lock). A kill during the loading is taken over at once: the loading goes on
    beside the resumed daemon, whose own warm-up then finds those kernels loaded. A standby for
    another shard (`shard`: index and count) than the checkpoint's is refused now, not at the takeover."""
    from ddiloco.core import checkpoint
    from ddiloco.net import ownership, store

    log.info("standby for %s: waiting for a checkpoint to load the kernels for", directory)
    while True:
        try:
            state, _ = store.newest_valid(directory)
            break
        except store.StoreError:
            try:  # the holder may be gone before its first checkpoint: the resume then says so
                return ownership.DirectoryLock.acquire(directory)
            except ownership.DirectoryHeld:
                time.sleep(STANDBY_POLL_S)
    try:
        checkpoint.check_resumed_shard(state, *shard)
    except checkpoint.CheckpointError as exc:
        raise UserError(f"cannot stand by for {directory}: {exc}") from exc
    threading.Thread(target=_preload, args=(state, directory, log), name="ddiloco-preload", daemon=True).start()
    lock = ownership.DirectoryLock.acquire(directory, wait=True)
    log.info("standby: took over %s", directory)
    return lock


def _preload(state: Any, directory: Path, log: logging.Logger) -> None:
    from ddiloco.net.warmup import syncer_warmup

    started = time.monotonic()
    try:
        for stage in syncer_warmup(state.config, state.layout):
            stage()
    except Exception as exc:  # a bug in the warm-up: the daemon's own warm-up loads them again
        log.error("standby: kernel loading failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        return
    log.info("standby for %s: kernels loaded in %.2f s", directory, time.monotonic() - started)


def _check_tls(v: dict[str, Any]) -> None:
    """Refuse a half-given or unusable certificate now, before the kernels warm up for seconds."""
    from ddiloco.net import tls

    if (v["tls_cert"] is None) != (v["tls_key"] is None):
        raise SettingsError("tls_cert and tls_key go together: give both or neither")
    if v["tls_cert"] is not None:
        tls.server_context(v["tls_cert"], v["tls_key"])


_SHARD_KEYS = ("shard", "shards")


def _shard_of(settings: Resolved) -> tuple[int, int]:
    """The shard and shard count the settings give (the core's defaults, 0 of 1, where they give none)."""
    v = settings.values
    return (0 if v["shard"] is None else v["shard"]), (1 if v["shards"] is None else v["shards"])


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        table, _, name = CORE_KEYS[key].rpartition(".")
        (out.setdefault(table, {}) if table else out)[name] = value
    return out


class _HeldRecords(logging.Handler):
    """Collects the records logged inside the `with` block, to be handled once logging is set up."""

    def __init__(self, level: str) -> None:
        super().__init__(level.upper())
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> Self:
        root = logging.getLogger()
        self._level = root.level
        # Handlers set up before (a standby logs while it waits) are set aside: held means not yet shown.
        self._handlers = root.handlers[:]
        for handler in self._handlers:
            root.removeHandler(handler)
        root.addHandler(self)
        root.setLevel(self.level)
        return self

    def __exit__(self, *exc: object) -> None:
        root = logging.getLogger()
        root.removeHandler(self)
        for handler in self._handlers:
            root.addHandler(handler)
        root.setLevel(self._level)

    def replay(self) -> None:
        for record in self.records:
            logging.getLogger(record.name).handle(record)


def _open_tape(v: dict[str, Any], state, log: logging.Logger):
    """The tape writer for `record`, started from the state the daemon is about to serve."""
    from ddiloco.core import tape as tapes
    from ddiloco.net import recording

    if v["record"] is None:
        return None
    source = f"resume {v['resume']}" if v["resume"] else f"init {v['init']}" if v["init"] else "no parameters"
    options = tapes.TapeOptions(keep_payloads=not v["record_no_payloads"])
    try:
        writer = recording.TapeWriter.create(v["record"], state, source, options)
    except tapes.TapeError as exc:
        raise UserError(str(exc)) from exc
    log.info(
        "recording the event tape in %s (payloads %s)", v["record"], "kept" if options.keep_payloads else "hashed only"
    )
    return writer
