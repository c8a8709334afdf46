"""The demo's evaluation: held-out loss and multiple-choice accuracy of a model, the merged one read
from the syncer's newest valid checkpoint."""

from __future__ import annotations

from pathlib import Path

import jax

from ddiloco.demo.config import DemoConfig, model_config
from ddiloco.learner.tree import TreeFragments
from ddiloco.reference import data
from ddiloco.reference import model as reference

__all__ = ["EVAL_WINDOWS", "checkpoint_params", "evaluate", "evaluate_checkpoint"]

EVAL_WINDOWS = 64


def evaluate(params, mcfg: reference.ModelConfig, choice=None) -> tuple[float, float | None]:
    """(held-out loss in nats per byte, multiple-choice accuracy or None without a scorer)."""
    x, y = data.eval_windows(mcfg.seq, EVAL_WINDOWS)
    loss = float(reference.make_eval(mcfg)(params, x, y))
    return loss, None if choice is None else choice(params)


def checkpoint_params(cfg: DemoConfig, ckpt_dir: Path):
    from ddiloco.net.store import newest_valid

    state, _ = newest_valid(ckpt_dir)
    mcfg = model_config(cfg)
    params = reference.init_params(mcfg, jax.random.PRNGKey(0))
    tree = TreeFragments(params, state.layout)
    for p, frag in enumerate(state.fragments):
        params = tree.scatter(params, p, frag.theta)
    return params


def evaluate_checkpoint(cfg: DemoConfig, ckpt_dir: Path) -> float:
    return evaluate(checkpoint_params(cfg, ckpt_dir), model_config(cfg))[0]
