"""One learner process: the reference model on its own data shard, synchronised with the syncer.

Readable top to bottom, in the spirit of a small `train.py`: build the model, connect, then loop
(inner AdamW step, sync hook) until this learner has taken its budget of steps (its own steps: a
learner that joins late, after others have spent theirs, still trains that many). A learner that is killed and
started again rejoins by itself: it copies parameters, AdamW state and step from a live peer that
holds the syncer's current versions (or, failing that, takes the syncer's fragments and a fresh
optimizer state), with weight 0 until it holds every fragment.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ddiloco.learner.sync import DilocoSync, SyncConfig
from ddiloco.learner.tape import LearnerTapeWriter, config_json
from ddiloco.net.peer import PeerConfig, PeerError
from ddiloco.reference import data
from ddiloco.reference import model as reference

log = logging.getLogger("ddiloco.learner")


@dataclass(frozen=True)
class LearnerConfig:
    syncer: str  # ws://host:port/ws, or wss://
    name: str
    shard: data.Shard
    token: str | None = None
    ca_file: Path | None = None  # wss://: trust only this CA (net.tls)
    lane: bool = True  # offer the syncer a lane for the bulk bytes (net.lane)
    model: reference.ModelConfig = field(default_factory=reference.ModelConfig)
    train: reference.TrainConfig = field(default_factory=reference.TrainConfig)
    batch: int = 16
    seed: int = 0
    codec: str = "int4"
    # Stop after this many steps of this process. Not the global step, which a learner joining late
    # continues from: counted that way, one joining after the others had spent the budget trained
    # nothing and ended with its random initialisation.
    steps_total: int = 200
    speed: float = 1.0  # < 1 makes this learner slower (sleeps after each step)
    log_file: Path | None = None  # JSON lines: step, loss, versions, tokens
    cache_dir: Path | None = None
    peer: PeerConfig | None = field(default_factory=PeerConfig)  # serve this learner's state to rejoining peers
    record: Path | None = None  # write this learner's tape here (learner.tape), for `ddiloco replay --full`
    restore: Path | None = None  # continue from this local state of a consistent snapshot (net.snapshot)

    def __post_init__(self) -> None:
        if not 0 < self.speed <= 1:
            raise ValueError(f"speed must lie in (0, 1], got {self.speed}")
        if self.batch < 1 or self.steps_total < 1:
            raise ValueError("batch and steps_total must be positive")


def _stop_on_sigterm() -> list:
    """A flag (a non-empty list once set) that SIGTERM sets: finish the step, say bye, exit 0."""
    flag: list = []
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: flag.append(True))
    return flag


def _compile(train_step: Any, params: Any, opt_state: Any, cfg: LearnerConfig) -> None:
    """Compile the step before joining: a learner that joins and then compiles for seconds is asked
    for fragments it cannot answer, and on shared cores the compiles of its peers starve the one
    that is training (measured: an 18 s gap between merges at the demo's start). The result of this
    step on a zero batch is thrown away; parameters, optimizer state and data are untouched.

    Said before and after, in the log and in the JSON lines (the demo's live view shows the
    learner as compiling): the compile takes seconds to tens of seconds on a loaded machine, and a
    learner silent that long looks stuck."""
    log.info("compiling the training step (the syncer hears of this learner after it)")
    _phase(cfg.log_file, {"phase": "compiling"})
    started = time.monotonic()
    zeros = np.zeros((cfg.batch, cfg.model.seq), dtype=np.int32)
    jax.block_until_ready(train_step(params, opt_state, zeros, zeros))
    seconds = time.monotonic() - started
    log.info("compiled in %.1f s; joining the syncer at %s", seconds, cfg.syncer)
    _phase(cfg.log_file, {"phase": "compiled", "seconds": round(seconds, 3)})


def _phase(log_file: Path | None, record: dict) -> None:
    """A line of the JSON log that is not a step's: what the process is doing (demo.supervisor.LossLog)."""
    if log_file is not None:
        with open(log_file, "a") as fh:
            fh.write(json.dumps(record) + "\n")


def _start_state(cfg: LearnerConfig, sync: DilocoSync, params: Any, opt_state: Any) -> tuple[Any, Any]:
    """A learner restored from a snapshot continues from its local state there; a (re)joining one
    copies a healthy peer's parameters, AdamW state and step when it can."""
    if cfg.restore is not None:
        try:
            return sync.restore(params, opt_state, cfg.restore.read_bytes())
        except (OSError, ValueError, PeerError) as exc:  # a damaged file, or a state that does not fit
            log.warning("not restoring from %s (%s): joining like a restarted learner", cfg.restore, exc)
    return sync.recover(params, opt_state)


def run_learner(cfg: LearnerConfig, replay: Any = None) -> dict:
    """Train `cfg.steps_total` steps (fewer when stopped); returns a small summary. `replay` (demo.replay)
    re-executes a recorded run instead: it stands in for the syncer and the peers, and says when the
    recorded run stopped."""
    reference.enable_compilation_cache(cfg.cache_dir)
    params = reference.init_params(cfg.model, jax.random.PRNGKey(cfg.seed))
    tx = reference.make_optimizer(cfg.train)
    opt_state = tx.init(params)
    train_step = reference.make_train_step(cfg.model, tx)
    _compile(train_step, params, opt_state, cfg)
    stream = data.batches(
        cfg.shard.slice(data.train_bytes()), cfg.batch, cfg.model.seq, np.random.default_rng(cfg.seed)
    )
    writer = LearnerTapeWriter.create(cfg.record, config_json(cfg)) if cfg.record is not None else None
    sync = DilocoSync.connect(
        params,
        SyncConfig(
            url=cfg.syncer,
            name=cfg.name,
            token=cfg.token,
            ca_file=cfg.ca_file,
            lane=cfg.lane,
            codec=cfg.codec,
            peer=cfg.peer,
        ),
        tape=writer,
        **(replay.sync_arguments() if replay is not None else {}),
    )
    joined = time.monotonic()
    params, opt_state = _start_state(cfg, sync, params, opt_state)
    caught_up_s = None
    tokens_per_step = cfg.batch * cfg.model.seq
    log_fh = open(cfg.log_file, "a", buffering=1) if cfg.log_file else None
    started, steps, ce, ce_array = time.monotonic(), 0, float("nan"), None
    stop = _stop_on_sigterm()
    try:
        while steps < cfg.steps_total and not stop and not (replay and replay.done(sync.calls)):
            t0 = time.perf_counter()
            x, y = next(stream)
            params, opt_state, ce_array = train_step(params, opt_state, x, y)
            params = sync.step(params, tokens=tokens_per_step, opt_state=opt_state)
            steps += 1
            if caught_up_s is None and min(sync.versions) >= 0:
                caught_up_s = time.monotonic() - joined
            if cfg.speed < 1:  # a slower chip: the step takes 1/speed as long
                time.sleep((time.perf_counter() - t0) * (1 / cfg.speed - 1))
            if log_fh and steps % 5 == 0:
                ce = float(ce_array)
                log_fh.write(
                    json.dumps(
                        {
                            "t": round(time.monotonic() - started, 3),
                            "learner": sync.learner_id,
                            "step": sync.step_count,
                            "loss": ce,
                            "versions": sync.versions,
                            "applied": sync.merged_versions_applied,
                        }
                    )
                    + "\n"
                )
        if ce_array is not None:  # the summary's loss is that of the last step taken
            ce = float(ce_array)
        # what was trained since the last pushes goes out, and is recorded before the tape closes
        sync.close(params)
        if writer is not None:
            writer.close(sync.calls, sync.step_count, sync.params_sha256(params))
    finally:
        sync.close()
        if writer is not None:
            writer.abandon()
        if log_fh:
            log_fh.close()
    if replay is not None:
        replay.finished(sync, params)
    return {
        "learner": sync.learner_id,
        "steps": steps,
        "last_step": sync.step_count,
        "loss": ce,
        "applied": sync.merged_versions_applied,
        "config": asdict(cfg)["name"],
        "recovered_from": sync.recovered_from,
        "recovery_s": round(sync.recovery_s, 3),
        "caught_up_s": None if caught_up_s is None else round(caught_up_s, 3),
    }


def learner_config_from_json(d: dict) -> LearnerConfig:
    """The `LearnerConfig` a learner tape's header holds (learner.tape.config_json), for a replay:
    no token, no files, no peer server (the replay stands in for peers)."""
    try:
        return LearnerConfig(
            syncer=d["syncer"],
            name=d["name"],
            shard=data.Shard(**d["shard"]),
            model=reference.ModelConfig(**d["model"]),
            train=reference.TrainConfig(**d["train"]),
            batch=d["batch"],
            seed=d["seed"],
            codec=d["codec"],
            steps_total=d["steps_total"],
            speed=d["speed"],
            peer=None,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the learner tape's configuration does not fit this version: {exc}") from exc
