import math

import jax
import numpy as np
import pytest

from ddiloco.learner.tree import tensor_specs
from ddiloco.reference import data, model


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
    # The scorer sees what the model learned: a true line of verse against byte noise of the same length.
    noise = np.random.default_rng(1)
    items = [
        data.ChoiceItem(
            it.context,
            tuple(
                it.options[it.answer]
                if k == it.answer
                else bytes(noise.integers(33, 127, len(it.options[it.answer]) - 1).astype(np.uint8)) + b"\n"
                for k in range(4)
            ),
            it.answer,
        )
        for it in data.choice_items(16, cfg.seq, seed=2)
    ]
    for ranking in ("sum", "per_byte"):
        assert model.make_choice_accuracy(cfg, items=items, ranking=ranking)(params) >= 0.9
    assert 0.0 <= model.make_choice_accuracy(cfg, count=16)(params) <= 1.0


def test_choice_scorer_sums_the_log_likelihood_of_the_option_bytes():
    cfg = model.ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, seq=64)
    params = model.init_params(cfg, jax.random.PRNGKey(3))
    items = data.choice_items(1, cfg.seq, seed=5)
    x, y, mask, _ = data.choice_arrays(items, cfg.seq)
    summed, per_byte = model.make_choice_scorer(cfg)(params, x, y, mask)
    for r, (item, option) in enumerate((it, o) for it in items for o in it.options):
        full = np.frombuffer(item.context + option, np.uint8).astype(np.int32)
        logits, _ = model.forward(params, full[None, :-1], cfg)  # unpadded: padding must change nothing
        logp = np.asarray(jax.nn.log_softmax(logits[0]))[np.arange(full.size - 1), full[1:]]
        expected = logp[len(item.context) - 1 :].sum()
        assert float(summed[r]) == pytest.approx(expected, rel=1e-4, abs=1e-3)
        assert float(per_byte[r]) == pytest.approx(expected / len(option), rel=1e-4, abs=1e-3)
    with pytest.raises(ValueError, match="ranking"):
        model.make_choice_accuracy(cfg, count=2, ranking="best")


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
