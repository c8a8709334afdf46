"""Deterministic simulation test of the syncer core: simulated learners and network, faults from one seed."""
