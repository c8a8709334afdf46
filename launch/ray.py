"""Launch a job on a Ray cluster: the syncer and M learners as Ray actors that Ray restarts.

    import ray
    from ddiloco.launch.plan import LaunchConfig
    from ddiloco.launch.ray import launch

    ray.init(address="auto")                      # or any ray.init; launch() calls ray.init() if none ran
    job = launch(LaunchConfig(learners=4, checkpoint_dir=Path("/shared/ck"), log_dir=Path("/shared/logs"),
                              token=token, learner_args=("--steps", "2000")))
    print(job.status()["merges"])
    job.wait()                                    # until every learner has spent its step budget
    job.shutdown()                                # learners say goodbye, the syncer writes a last checkpoint

Each actor runs the same command a user runs by hand (`ddiloco syncer`, `ddiloco learner`) as a
supervised child process (`launch.process`): the actor is the unit Ray places, restarts and kills;
the command is the unit that trains. A child that fails ends its actor's process, so one restart
policy covers both a lost node and a crashed command:

- the syncer actor asks for CPUs only (`syncer_cpus`, plus `syncer_resources` to pin it to a node),
  listens on a fixed port and, started again by Ray, resumes from the newest checkpoint in
  `checkpoint_dir`; learners reconnect to it by themselves (their client retries with backoff);
- learner actors ask for one GPU each where the cluster has GPUs (`learner_gpus`), else CPUs, are
  spread over the nodes, and a restarted one rejoins by itself like any restarted learner (it
  recovers parameters and optimizer state from a live peer or the syncer).

With `shards` > 1 the syncer is that many actors, shard i on `port + i` with its own checkpoint
directory (launch.plan), and every learner dials them all.

The token and any TLS key travel to the actors as arguments (Ray's own channels: run Ray with TLS
across untrusted networks) and reach the commands as 0600 files in 0700 temporary directories.
"""

from __future__ import annotations

import json
import logging
import os
import re
import ssl
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from ddiloco.launch.plan import (
    LaunchConfig,
    learner_argv,
    shard_checkpoint_dir,
    syncer_argv,
    syncer_log_name,
    syncer_urls,
)
from ddiloco.launch.process import LaunchError, PrivateDir, Supervised, ddiloco_command
from ddiloco.net import store
from ddiloco.net.shard_status import merge_status

__all__ = ["LearnerActor", "RayLaunch", "SyncerActor", "launch"]

log = logging.getLogger("ddiloco.launch")

_LISTENING = r"syncer listening on \S+:(\d+)"
_PORT_BUSY = re.compile(r"address already in use", re.IGNORECASE)
PORT_RETRY_S = 1.0  # a predecessor still writing its last checkpoint holds the port this long between tries
STATUS_TIMEOUT_S = 30.0
RUN_OUTPUT_BYTES_MAX = 1 << 16


def _fail_actor(what: str, code: int) -> None:
    """An unasked exit of the command ends the actor's process: Ray's restart policy takes over."""
    log.error("%s exited with %d: ending this actor so that Ray restarts it", what, code)
    os._exit(1)


def _resume_from(checkpoint_dir: Path) -> bool:
    """True when `checkpoint_dir` holds a valid checkpoint. Checkpoints that are all damaged are
    refused rather than silently replaced by a fresh start."""
    try:
        store.newest_valid(checkpoint_dir)
        return True
    except store.StoreError as exc:
        if checkpoint_dir.is_dir() and any(store.runs_in(checkpoint_dir)):
            raise LaunchError(
                f"no valid checkpoint in {checkpoint_dir} though it holds some ({exc}): "
                "not starting over them; move them away to start afresh"
            ) from exc
        return False


class SyncerActor:
    """`ddiloco syncer` (shard `shard` of `config.shards`) on this node; the constructor returns once it listens."""

    def __init__(self, config: LaunchConfig, shard: int = 0) -> None:
        self.config = config
        self.shard = shard
        checkpoint_dir = shard_checkpoint_dir(config, shard)
        log_path = config.log_dir / syncer_log_name(config, shard)
        self.files = PrivateDir("ddiloco-syncer-")
        token_file = self.files.write("token", config.token + "\n")
        tls_files = (
            (self.files.write("tls.crt", config.tls_cert), self.files.write("tls.key", config.tls_key))
            if config.tls
            else None
        )
        self.ca_file = self.files.write("ca.crt", config.tls_ca) if config.tls_ca is not None else None
        deadline = time.monotonic() + config.ready_s_max
        while True:
            self.resumed = _resume_from(checkpoint_dir)  # decided per try: a predecessor may just have written one
            argv = ddiloco_command("syncer", syncer_argv(config, token_file, self.resumed, tls_files, shard))
            self.child = Supervised(argv, log_path)
            self.child.start()
            try:
                self.child.wait_for_line(_LISTENING, max(1.0, deadline - time.monotonic()))
                break
            except LaunchError:
                busy = self.child.returncode is not None and _PORT_BUSY.search(
                    self.child.run_output(RUN_OUTPUT_BYTES_MAX)
                )
                if not busy or time.monotonic() + PORT_RETRY_S > deadline:
                    self.child.stop()
                    self.files.close()
                    raise
                time.sleep(PORT_RETRY_S)  # the previous syncer of this job is still shutting down
        self.child.on_exit = lambda code: _fail_actor("the syncer", code)
        if self.child.returncode is not None:  # exited between listening and being watched
            _fail_actor("the syncer", self.child.returncode)
        self.url, self.status_url = syncer_urls(config, ray.util.get_node_ip_address(), shard)

    def address(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "status_url": self.status_url,
            "pid": os.getpid(),
            "resumed": self.resumed,
            "shard": self.shard,
        }

    def status(self) -> dict[str, Any]:
        """The syncer's /status document, read on its own node through the URL the learners use."""
        context = (
            ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None) if self.config.tls else None
        )
        with urllib.request.urlopen(f"{self.status_url}/status", timeout=STATUS_TIMEOUT_S, context=context) as resp:
            return json.loads(resp.read())

    def stop(self) -> int | None:
        """SIGTERM: the syncer closes its connections and writes a last checkpoint."""
        code = self.child.stop()
        self.files.close()
        return code


class LearnerActor:
    """`ddiloco learner` number `index` on this node. A learner that has spent its step budget exits 0
    and stays done; any other exit ends the actor, which Ray starts again (the learner rejoins)."""

    def __init__(self, config: LaunchConfig, index: int, syncer_url: str | list[str]) -> None:
        self.files = PrivateDir(f"ddiloco-learner-{index}-")
        token_file = self.files.write("token", config.token + "\n")
        ca_file = self.files.write("ca.crt", config.tls_ca) if config.tls_ca is not None else None
        argv = ddiloco_command("learner", learner_argv(config, index, syncer_url, token_file, ca_file))
        self.child = Supervised(argv, config.log_dir / f"learner-{index}.log", on_exit=self._exited)
        self.child.start()
        self.index = index

    def _exited(self, code: int) -> None:
        if code != 0:
            _fail_actor(f"learner {self.index}", code)

    def pid(self) -> int:
        return os.getpid()

    def poll(self) -> int | None:
        """None while the learner trains; 0 once it has spent its step budget."""
        return self.child.returncode

    def stop(self) -> int | None:
        """SIGTERM: the learner finishes its step, says goodbye and exits 0."""
        code = self.child.stop()
        self.files.close()
        return code


@dataclass
class RayLaunch:
    """A launched job: the actors, where the syncer is, and how to watch and end it. With a sharded
    syncer, `syncer`, `syncer_url` and `status_url` are shard 0's; the lists hold every shard's."""

    config: LaunchConfig
    syncer: Any  # ray.actor.ActorHandle of SyncerActor
    learners: list  # ActorHandles of LearnerActor, by index
    syncer_url: str
    status_url: str
    syncers: list = field(default_factory=list)  # every shard's SyncerActor handle, by shard
    syncer_urls: list = field(default_factory=list)
    status_urls: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.syncers = self.syncers or [self.syncer]
        self.syncer_urls = self.syncer_urls or [self.syncer_url]
        self.status_urls = self.status_urls or [self.status_url]

    def status(self, timeout_s: float = STATUS_TIMEOUT_S) -> dict[str, Any]:
        """The syncer's /status (merges, learners and their states, fragment versions); of a
        sharded syncer, the shards' merged (net.shard_status), a shard that does not answer shown down."""
        if len(self.syncers) == 1:
            return ray.get(self.syncer.status.remote(), timeout=timeout_s)
        readings = []
        for url, actor in zip(self.status_urls, self.syncers, strict=True):
            try:
                readings.append((url, ray.get(actor.status.remote(), timeout=timeout_s), None))
            except Exception as exc:  # noqa: BLE001 - a shard down (restarting, unreachable) is a row, not a failure
                readings.append((url, None, f"{type(exc).__name__}: {exc}"))
        return merge_status(readings)

    def wait(self, timeout_s: float | None = None, poll_s: float = 1.0) -> list[int]:
        """Block until every learner has spent its step budget (their exit codes, all 0). A learner
        being restarted is waited for; one that Ray gave up on raises LaunchError."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        codes: dict[int, int] = {}
        while len(codes) < len(self.learners):
            for index, actor in enumerate(self.learners):
                if index in codes:
                    continue
                try:
                    code = ray.get(actor.poll.remote(), timeout=poll_s)
                except ActorDiedError as exc:
                    raise LaunchError(
                        f"learner {index} is gone for good (restarts spent?): {exc}; "
                        f"see {self.config.log_dir / f'learner-{index}.log'}"
                    ) from exc
                except (GetTimeoutError, RayActorError):
                    continue  # being restarted
                if code is not None:
                    codes[index] = code
            if deadline is not None and time.monotonic() > deadline and len(codes) < len(self.learners):
                raise TimeoutError(f"{len(self.learners) - len(codes)} learners still training after {timeout_s} s")
            if len(codes) < len(self.learners):
                time.sleep(poll_s)  # the next round of polls
        return [codes[i] for i in range(len(self.learners))]

    def shutdown(self, timeout_s: float = 120.0) -> None:
        """Learners first (they say goodbye), then the syncer (a last checkpoint), then the actors."""
        for group in (self.learners, self.syncers):
            pending = [actor.stop.remote() for actor in group]
            try:
                ray.get(pending, timeout=timeout_s)
            except (GetTimeoutError, RayActorError) as exc:
                log.warning("not every actor stopped cleanly: %s", exc)
        for actor in [*self.learners, *self.syncers]:
            ray.kill(actor, no_restart=True)


def _learner_gpus(config: LaunchConfig) -> float:
    if config.learner_gpus is not None:
        return config.learner_gpus
    return 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0


def launch(config: LaunchConfig) -> RayLaunch:
    """Start the syncer (each of its shards), wait until it listens, start the learners; returns the job's handle."""
    if not ray.is_initialized():
        ray.init()
    # max_task_retries=-1: a call made while an actor restarts waits for the new one, and fails with
    # ActorDiedError only when Ray has given up on it.
    syncer_cls = ray.remote(SyncerActor).options(
        num_cpus=config.syncer_cpus,
        resources=dict(config.syncer_resources),
        max_restarts=config.syncer_max_restarts,
        max_task_retries=-1,
    )
    syncers = [syncer_cls.remote(config, shard) for shard in range(config.shards)]
    wheres = []
    for shard, syncer in enumerate(syncers):
        try:
            wheres.append(ray.get(syncer.address.remote(), timeout=config.ready_s_max + 60))
        except (GetTimeoutError, RayActorError) as exc:
            for actor in syncers:
                ray.kill(actor, no_restart=True)
            log_path = config.log_dir / syncer_log_name(config, shard)
            raise LaunchError(f"the syncer did not come up: {exc}; see {log_path}") from exc
    urls = [w["url"] for w in wheres]
    gpus = _learner_gpus(config)
    learner_cls = ray.remote(LearnerActor).options(
        num_cpus=config.learner_cpus,
        num_gpus=gpus,
        resources=dict(config.learner_resources),
        max_restarts=config.learner_max_restarts,
        max_task_retries=-1,
        scheduling_strategy="SPREAD",
    )
    learners = [learner_cls.remote(config, i, urls) for i in range(config.learners)]
    log.info(
        "launched: syncer at %s (%s), %d learners (%s GPU each)",
        ",".join(urls),
        ", ".join("resumed" if w["resumed"] else "fresh" for w in wheres),
        config.learners,
        gpus,
    )
    return RayLaunch(
        config,
        syncers[0],
        learners,
        urls[0],
        wheres[0]["status_url"],
        syncers,
        urls,
        [w["status_url"] for w in wheres],
    )
