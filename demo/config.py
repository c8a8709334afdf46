"""The demo's configuration: what `ddiloco demo` runs (the CLI takes its defaults from here)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddiloco.reference import model as reference

__all__ = ["GPUS_MAX", "LOG_EVERY_STEPS", "STEPS_CAP_FACTOR", "DemoConfig", "model_config"]

GPUS_MAX = 1024  # more than any one host holds: a larger count is a typo
LOG_EVERY_STEPS = 5  # a learner writes one JSON line per this many of its steps (demo/learner_process.py)
# Learners are stopped at this many times `steps` global steps, budget spent or not (the supervisor
# watches the global step); each learner process also stops after this many times `steps` of its own.
STEPS_CAP_FACTOR = 2


@dataclass(frozen=True)
class DemoConfig:
    learners: int = 4
    steps: int = 400  # the budget in data-parallel steps (see token_budget); the schedule's length too
    batch: int = 8
    fragments: int = 4
    # H: steps between two syncs of one fragment. Measured with `ddiloco demo --no-chaos --baseline
    # none` on a 400-step budget (eval loss, DP 2.220): H = 12 2.309 / 2.371, H = 24 2.359 / 2.478.
    period: int = 12
    # tau: steps a fragment may stay in flight; a request is answered within about a step (85 ms
    # median of a ~100 ms step with 4 learners on 2 cores), and 4 steps leave the grace window room.
    overlap: int = 4
    quorum: int = 1
    chaos: bool = True
    kills: int = 3
    pauses: int = 2
    restart_delay_s: float = 3.0
    pause_s: float = 3.0
    speeds: tuple[float, ...] = ()
    baseline: bool = True
    seed: int = 0
    model: str = "dense"
    kill_syncer: bool = False  # SIGKILL the syncer once and restart it with --resume
    # The syncer is restarted at once, as a service manager restarts a crashed daemon (systemd's
    # Restart=always); restart_delay_s is a learner's (a machine that comes back). The outage
    # reported is from the kill to the restarted syncer's first merge, this delay included.
    syncer_restart_delay_s: float = 0.0
    # With kill_syncer: a hot standby (`ddiloco syncer --standby`, started beside the syncer, its
    # imports and kernels loaded) takes over at the kill instead of a cold restart. False: the
    # cold restart above (`--cold-restart`), to compare.
    syncer_standby: bool = True
    checkpoint_every_s: float = 2.0  # often, so that a syncer restart loses little
    # Plain averaging of the merged fragments (lr 1, no momentum): the paper's 0.7 / 0.9 are for
    # hundreds of inner steps between syncs; at the demo's H = 12-24 they over-step. Measured with
    # `ddiloco demo --no-chaos --baseline none` at H = 24: eval loss 2.630 with 0.7 / 0.9, 2.359 with 1 / 0.
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    merge: str = "rda"  # how the syncer merges outer gradients: rda | mean
    grace_ms_max: float = 1000.0
    grace_gamma: float = 0.5
    choice_items: int = reference.CHOICE_ITEMS  # multiple-choice items per evaluated model
    # Record the whole run here for `ddiloco replay DIR --full`: the syncer's tape (push payloads by
    # hash only: the replay regenerates them) and one tape per learner incarnation (learner.tape).
    record: Path | None = None
    # Consistent snapshots (net.snapshot) into <workdir>/snapshots every this many seconds (0: only
    # on `ddiloco snapshot URL`); `restore` restarts the whole system from one of them.
    snapshot_every_s: float = 0.0
    restore: Path | None = None
    # GPUs the learners share out (learner.devices.learner_device_plan): None counts them
    # (learner.devices.visible_gpu_count, without starting JAX in the supervisor); 0 keeps every
    # learner on what JAX finds, as on a host without GPUs.
    gpus: int | None = None
    # The learners' JAX persistent compilation cache; None: <workdir>/jax-cache. Runs that share one
    # (the tests' demo runs) compile the training step once.
    cache_dir: Path | None = None

    @property
    def token_budget(self) -> int:
        """What the learners train on in all, and the data-parallel baseline too."""
        return self.steps * self.learners * self.batch * model_config(self).seq

    def __post_init__(self) -> None:
        if self.learners < 1 or self.steps < 10 or self.batch < 1:
            raise ValueError("need at least 1 learner, 10 steps and a batch of 1")
        if self.speeds and len(self.speeds) != self.learners:
            raise ValueError(f"--speeds has {len(self.speeds)} values for {self.learners} learners")
        if any(not 0 < v <= 1 for v in self.speeds):
            raise ValueError(f"every speed must lie in (0, 1], got {self.speeds}")
        if min(self.kills, self.pauses, self.restart_delay_s, self.pause_s, self.syncer_restart_delay_s) < 0:
            raise ValueError("kills, pauses and their delays must be non-negative")
        if self.model not in ("dense", "moe"):
            raise ValueError(f"model must be dense or moe, got {self.model!r}")
        if self.choice_items < 1:
            raise ValueError(f"choice_items must be positive, got {self.choice_items}")
        if self.checkpoint_every_s <= 0:
            raise ValueError("checkpoint_every_s must be positive (the demo resumes from checkpoints)")
        if self.merge not in ("rda", "mean"):
            raise ValueError(f"merge must be rda or mean, got {self.merge!r}")
        if self.snapshot_every_s < 0:
            raise ValueError("snapshot_every_s must be non-negative")
        if self.gpus is not None and not 0 <= self.gpus <= GPUS_MAX:
            raise ValueError(f"gpus must lie in [0, {GPUS_MAX}], got {self.gpus}")


def model_config(cfg: DemoConfig) -> reference.ModelConfig:
    return reference.ModelConfig(experts=4 if cfg.model == "moe" else 0)
