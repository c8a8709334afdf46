"""The outer optimizer: SGD with Nesterov momentum over each fragment, fp32.

docs/algorithm.md, "Syncer: one round of fragment p", item 6.

    buf   <- mu * buf + Delta
    Theta <- Theta - lr * (Delta + mu * buf)

As in optax, the optimizer is a pair of pure functions over a state value: `init` and `update`. The
syncer holds fragments of tens of millions of values, so `update` may be told to reuse (donate) the
arrays it was given instead of copying them; the caller then must not use the old values again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ddiloco import kernels
from ddiloco.core.merge import MergedGradient
from ddiloco.errors import UserError


class OuterConfigError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class OuterConfig:
    lr: float = 0.7  # DiLoCo's outer learning rate
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise OuterConfigError(f"outer learning rate must be a positive finite number, got {self.lr!r}")
        if not (math.isfinite(self.momentum) and 0 <= self.momentum < 1):
            raise OuterConfigError(f"outer momentum must lie in [0, 1), got {self.momentum!r}")


class NesterovState(NamedTuple):
    buf: np.ndarray  # float32[n], the momentum of one fragment


def init(theta: np.ndarray) -> NesterovState:
    return NesterovState(buf=np.zeros_like(theta, dtype=np.float32))


def update(
    state: NesterovState,
    theta: np.ndarray,
    delta: np.ndarray | MergedGradient,
    config: OuterConfig,
    *,
    donate: bool = False,
) -> tuple[np.ndarray, NesterovState]:
    """(new Theta, new state) after one outer step with merged outer gradient `delta`: an array, or a
    round's MergedGradient (core.merge.merge_round), whose remaining merge work is fused into the step
    (the same bits as stepping with its values())."""
    delta_shape = (delta.size,) if isinstance(delta, MergedGradient) else delta.shape
    if not (theta.shape == delta_shape == state.buf.shape):
        raise ValueError(f"shapes differ: theta {theta.shape}, delta {delta_shape}, buf {state.buf.shape}")
    new_theta = theta if donate else theta.copy()
    new_buf = state.buf if donate else state.buf.copy()
    if isinstance(delta, MergedGradient):
        delta.nesterov_step(new_theta, new_buf, config.lr, config.momentum)
    else:
        kernels.nesterov_step(new_theta, new_buf, delta, config.lr, config.momentum)
    return new_theta, NesterovState(buf=new_buf)
