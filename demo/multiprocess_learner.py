"""One learner of the reference model over several JAX processes (`ddiloco learner --num-processes N`).

Data parallel inside the learner: the parameters and AdamW state are replicated over every device of
every process, each process draws its own share of the learner's batch (`batch / N` rows, from the
learner's data shard with its own random stream), and the jitted step averages the gradients over
all devices. The learner syncs through `learner.multihost.MultiProcessSync`: process 0 talks to the
syncer, the others take part in its collectives. Every process runs the same loop for the same
number of steps; a process that dies ends the learner (the others exit with the error at once,
see learner/multihost.py). No SIGTERM handling: the processes must stop at the same step, and one
signalled alone would leave the others waiting, so a signal ends the whole learner like a kill.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ddiloco.demo.learner_process import LearnerConfig
from ddiloco.errors import UserError
from ddiloco.learner.multihost import LearnerProcessLost, MultiProcessSync
from ddiloco.learner.sync import SyncConfig
from ddiloco.reference import data
from ddiloco.reference import model as reference

__all__ = ["ProcessSetup", "run_multiprocess_learner"]

log = logging.getLogger("ddiloco.learner")

_AXIS = "data"


@dataclass(frozen=True)
class ProcessSetup:
    """Where this process sits in its learner (jax.distributed is initialised from it beforehand)."""

    coordinator: str
    num_processes: int
    process_id: int


def _replicated(tree: Any, sharding: NamedSharding) -> Any:
    """Every process holds the same values (same seed): a global array replicated over the mesh."""
    return jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, sharding, lambda i: np.asarray(x)[i]), tree)


def _global_batch(mesh: Mesh, *local: np.ndarray) -> tuple[jax.Array, ...]:
    return tuple(multihost_utils.host_local_array_to_global_array(a, mesh, PartitionSpec(_AXIS)) for a in local)


def run_multiprocess_learner(cfg: LearnerConfig, setup: ProcessSetup) -> dict:
    """Train `cfg.steps_total` steps of one learner spread over `setup.num_processes` processes.
    Raises LearnerProcessLost when another process of the learner is gone (the caller exits)."""
    if cfg.batch % setup.num_processes or (cfg.batch // setup.num_processes) % jax.local_device_count():
        raise UserError(
            f"the learner's batch ({cfg.batch}) must split evenly over {setup.num_processes} processes "
            f"and then over each process's {jax.local_device_count()} devices"
        )
    reference.enable_compilation_cache(cfg.cache_dir)
    mesh = Mesh(np.array(jax.devices()), (_AXIS,))
    replicated = NamedSharding(mesh, PartitionSpec())
    params = _replicated(reference.init_params(cfg.model, jax.random.PRNGKey(cfg.seed)), replicated)
    tx = reference.make_optimizer(cfg.train)
    opt_state = jax.jit(tx.init, out_shardings=replicated)(params)
    train_step = reference.make_train_step(cfg.model, tx)
    local_batch = cfg.batch // setup.num_processes
    zeros = np.zeros((local_batch, cfg.model.seq), dtype=np.int32)
    # Compile before joining (docs/learner.md), and on the step's own outputs too: jit may spell
    # their shardings differently from the inputs', which is a second cache entry.
    started = time.monotonic()
    warm = train_step(params, opt_state, *_global_batch(mesh, zeros, zeros))
    jax.block_until_ready(train_step(warm[0], warm[1], *_global_batch(mesh, zeros, zeros)))
    log.info("process %d: compiled in %.1f s", setup.process_id, time.monotonic() - started)
    rng = np.random.default_rng([cfg.seed, setup.process_id])
    stream = data.batches(cfg.shard.slice(data.train_bytes()), local_batch, cfg.model.seq, rng)
    config = SyncConfig(
        url=cfg.syncer, name=cfg.name, token=cfg.token, ca_file=cfg.ca_file, lane=cfg.lane, codec=cfg.codec
    )
    sync = MultiProcessSync(params, config)
    log_fh = open(cfg.log_file, "a", buffering=1) if cfg.log_file and sync.is_leader else None
    steps, ce, ce_array, t0 = 0, float("nan"), None, time.monotonic()
    train_s: list[float] = []  # each training step, its batch and its results included
    sync_s: list[float] = []  # sync.step, every step
    quiet_s: list[float] = []  # sync.step on the steps where nothing was read or arrived
    try:
        while steps < cfg.steps_total:
            began = time.perf_counter()
            x, y = next(stream)
            try:
                params, opt_state, ce_array = train_step(params, opt_state, *_global_batch(mesh, x, y))
            except jax.errors.JaxRuntimeError as exc:  # a collective of the step failed: a process is gone
                raise LearnerProcessLost(f"the training step failed: another process is gone ({exc})") from exc
            # Wait for the step here, so that the time of `sync.step` below is its own (it would
            # wait for the same thing first).
            jax.block_until_ready(params)
            synced = time.perf_counter()
            params = sync.step(params, tokens=cfg.batch * cfg.model.seq)
            train_s.append(synced - began)
            sync_s.append(time.perf_counter() - synced)
            if sync.last_step_quiet:
                quiet_s.append(sync_s[-1])
            steps += 1
            if log_fh and steps % 5 == 0:
                record = {"t": round(time.monotonic() - t0, 3), "step": steps, "loss": float(ce_array)}
                log_fh.write(json.dumps(record | {"applied": sync.fragments_applied}) + "\n")
        if ce_array is not None:
            ce = float(ce_array)
    finally:
        sync.close()
        if log_fh:
            log_fh.close()
    return {
        "process": setup.process_id,
        "processes": setup.num_processes,
        "learner": sync.sync.learner_id if sync.sync is not None else None,
        "steps": steps,
        "loss": ce,
        "applied": sync.fragments_applied,
        # What a step of the whole learner costs the sync on the steps where nothing happens (the
        # header's broadcast), beside the time the training step was waited for.
        "quiet_steps": len(quiet_s),
        "quiet_sync_ms_median": _median_ms(quiet_s),
        "sync_ms_median": _median_ms(sync_s),
        "train_step_ms_median": _median_ms(train_s),
    }


def _median_ms(seconds: list[float]) -> float | None:
    return round(float(np.median(seconds)) * 1e3, 3) if seconds else None
