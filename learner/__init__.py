"""The JAX side: pytree <-> fragments, the sync hook, reference models and the demo."""
