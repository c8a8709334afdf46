"""Launching a job across machines: the syncer and its learners on an existing engine.

`plan` holds what a launch runs (a `LaunchConfig` and the command lines it gives), `process` runs one
command under a supervisor that may itself be killed, and `ray` carries a plan out as Ray actors
with restart policies. The SLURM script and Kubernetes manifests in the repository's `deploy/`
folder run the same two commands, `ddiloco syncer` and `ddiloco learner`.
"""
