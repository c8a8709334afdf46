"""Pure, synchronous, deterministic Decoupled DiLoCo logic (no I/O, no clock, no global RNG)."""
