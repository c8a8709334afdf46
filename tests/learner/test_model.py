import math

import jax
import numpy as np
import pytest

from ddiloco.learner import data, model
from ddiloco.learner.tree import tensor_specs


def count(params):
    return sum(x.size for x in jax.tree_util.tree_leaves(params))


@pytest.mark.parametrize("experts", [0, 4])
def test_training_on_shakespeare_lowers_held_out_loss(experts, tmp_path):
    model.enable_compilation_cache(tmp_path / "jax-cache")
    cfg = model.ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, seq=32, experts=experts)
    tc = model.TrainConfig(lr=1e-2, warmup_steps=5, total_steps=60)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    tx = model.make_optimizer(tc)
    opt_state = tx.init(params)
    step = model.make_train_step(cfg, tx)
    evaluate = model.make_eval(cfg)
    ex, ey = data.eval_windows(cfg.seq, 32)
    before = float(evaluate(params, ex, ey))
    assert before == pytest.approx(math.log(256), rel=0.05)  # an untrained byte model is near uniform
    stream = data.batches(data.Shard(0, 2).slice(data.train_bytes()), 16, cfg.seq, np.random.default_rng(0))
    for _ in range(60):
        x, y = next(stream)
        params, opt_state, ce = step(params, opt_state, x, y)
        assert np.isfinite(float(ce))
    after = float(evaluate(params, ex, ey))
    assert after < before - 1.0, (before, after)  # well below uniform: it learned byte statistics


def test_default_size_and_names_for_the_sync_hook():
    cfg = model.ModelConfig()
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    assert 350_000 < count(params) < 500_000
    specs = {s.path: s for s in tensor_specs(params)}
    assert specs["embed"].embedding and specs["pos_embed"].embedding
    assert "blocks/1/attn/qkv" in specs and not specs["blocks/1/attn/qkv"].embedding
    moe = model.init_params(model.ModelConfig(experts=4), jax.random.PRNGKey(0))
    assert "blocks/0/mlp/router" in {s.path for s in tensor_specs(moe)}


def test_bad_model_configs():
    with pytest.raises(ValueError, match="multiple of n_heads"):
        model.ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="top_k"):
        model.ModelConfig(experts=2, top_k=3)
