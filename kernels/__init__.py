"""numba CPU kernels behind validating wrappers, each with a numpy reference."""
