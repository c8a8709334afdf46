"""The data-parallel baseline the demo's merged model is measured against, trained in this process."""

from __future__ import annotations

import jax
import numpy as np

from ddiloco.demo.config import DemoConfig, model_config
from ddiloco.reference import data
from ddiloco.reference import model as reference

__all__ = ["train_baseline"]


def train_baseline(cfg: DemoConfig) -> tuple[dict, list[list[float]]]:
    """Data-parallel on the same token budget: one model, a batch M times larger, as many steps.
    Returns the parameters and the train loss every 10 steps against tokens."""
    mcfg = model_config(cfg)
    tcfg = reference.TrainConfig(total_steps=max(cfg.steps, 21))
    params = reference.init_params(mcfg, jax.random.PRNGKey(cfg.seed))
    tx = reference.make_optimizer(tcfg)
    opt_state = tx.init(params)
    step = reference.make_train_step(mcfg, tx)
    stream = data.batches(data.train_bytes(), cfg.batch * cfg.learners, mcfg.seq, np.random.default_rng(cfg.seed))
    tokens_per_step, curve, window = cfg.batch * cfg.learners * mcfg.seq, [], []
    for i in range(cfg.steps):
        x, y = next(stream)
        params, opt_state, ce = step(params, opt_state, x, y)
        window.append(ce)
        if len(window) == 10:
            curve.append([(i + 1 - 5) * tokens_per_step, float(np.mean([float(c) for c in window]))])
            window = []
    return params, curve
