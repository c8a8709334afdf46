"""The learner library: pytree <-> fragments, the per-step sync hook, peer recovery, learner tapes."""
