"""The reference models: a byte-level decoder-only transformer, dense or mixture-of-experts.

Small on purpose (the default is about 0.4M parameters, which trains at several steps per second on
two CPU cores), and written to be read top to bottom. Parameters are a plain dict pytree, so the
sync hook sees names like "blocks/0/attn/qkv". The MoE variant routes each token to its top-k experts
and adds the usual load-balancing loss (the share of tokens per expert times the mean router
probability per expert, scaled by the number of experts; Fedus et al., "Switch Transformers", 2021).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ddiloco.reference import data
from ddiloco.reference.data import VOCAB

CHOICE_ITEMS = 200  # multiple-choice items per evaluation (800 scored rows; well under a second on CPU)


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 512
    seq: int = 64
    experts: int = 0  # 0: dense MLP; otherwise the number of experts in every MLP
    top_k: int = 2
    aux_weight: float = 0.01  # load-balancing loss weight (MoE only)

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} must be a multiple of n_heads {self.n_heads}")
        if min(self.d_model, self.n_layers, self.n_heads, self.d_ff, self.seq) < 1:
            raise ValueError("model sizes must be positive")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must lie in [1, experts={self.experts}], got {self.top_k}")


@dataclass(frozen=True)
class TrainConfig:
    lr: float = 3e-3
    warmup_steps: int = 20
    total_steps: int = 1000
    weight_decay: float = 0.1
    clip_norm: float = 1.0

    def __post_init__(self) -> None:
        if not (self.lr > 0 and 0 <= self.warmup_steps < self.total_steps):
            raise ValueError("need lr > 0 and 0 <= warmup_steps < total_steps")


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    keys = iter(jax.random.split(key, 4 + 8 * cfg.n_layers))
    d = cfg.d_model

    def dense(shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)

    blocks = []
    for _ in range(cfg.n_layers):
        mlp = (
            {"up": dense((d, cfg.d_ff), d), "down": dense((cfg.d_ff, d), cfg.d_ff)}
            if not cfg.experts
            else {
                "router": dense((d, cfg.experts), d),
                "up": dense((cfg.experts, d, cfg.d_ff), d),
                "down": dense((cfg.experts, cfg.d_ff, d), cfg.d_ff),
            }
        )
        blocks.append(
            {
                "norm1": jnp.ones((d,)),
                "norm2": jnp.ones((d,)),
                "attn": {"qkv": dense((d, 3 * d), d), "out": dense((d, d), d)},
                "mlp": mlp,
            }
        )
    return {
        "embed": jax.random.normal(next(keys), (VOCAB, d), jnp.float32) * 0.02,
        "pos_embed": jax.random.normal(next(keys), (cfg.seq, d), jnp.float32) * 0.02,
        "blocks": blocks,
        "final_norm": jnp.ones((d,)),
    }


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _attention(p: dict, x: jax.Array, n_heads: int) -> jax.Array:
    b, t, d = x.shape
    q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
    heads = lambda z: z.reshape(b, t, n_heads, d // n_heads).transpose(0, 2, 1, 3)  # [b, h, t, dh]
    q, k, v = heads(q), heads(k), heads(v)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // n_heads)
    causal = jnp.tril(jnp.ones((t, t), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    return (weights @ v).transpose(0, 2, 1, 3).reshape(b, t, d) @ p["out"]


def _mlp(p: dict, x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """(output, load-balancing loss); dense models have no balancing loss."""
    if not cfg.experts:
        return jax.nn.gelu(x @ p["up"]) @ p["down"], jnp.float32(0)
    probs = jax.nn.softmax(x @ p["router"], axis=-1)  # [b, t, E]
    top, idx = jax.lax.top_k(probs, cfg.top_k)
    gates = jnp.sum(jax.nn.one_hot(idx, cfg.experts) * (top / jnp.sum(top, -1, keepdims=True))[..., None], axis=-2)
    # Tiny models: run every expert and keep the routed ones (a real MoE would dispatch instead).
    hidden = jax.nn.gelu(jnp.einsum("btd,edf->btef", x, p["up"]))
    out = jnp.einsum("btef,efd,bte->btd", hidden, p["down"], gates)
    routed_share = jnp.mean(gates > 0, axis=(0, 1)) / cfg.top_k  # fraction of assignments per expert
    balance = cfg.experts * jnp.sum(routed_share * jnp.mean(probs, axis=(0, 1)))
    return out, balance


def forward(params: dict, x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """(logits [b, t, 256], mean load-balancing loss over layers) for byte inputs x [b, t]."""
    h = params["embed"][x] + params["pos_embed"][: x.shape[1]]
    balance = jnp.float32(0)
    for block in params["blocks"]:
        h = h + _attention(block["attn"], _rms_norm(h, block["norm1"]), cfg.n_heads)
        out, aux = _mlp(block["mlp"], _rms_norm(h, block["norm2"]), cfg)
        h, balance = h + out, balance + aux
    logits = _rms_norm(h, params["final_norm"]) @ params["embed"].T  # tied output head
    return logits, balance / cfg.n_layers


def loss(params: dict, x: jax.Array, y: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """(training loss with the balancing term, plain next-byte cross entropy in nats)."""
    logits, balance = forward(params, x, cfg)
    ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
    return ce + cfg.aux_weight * balance, ce


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """Inner AdamW with linear warmup and cosine decay, gradients clipped by global norm."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps, tc.total_steps, tc.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(tc.clip_norm), optax.adamw(schedule, weight_decay=tc.weight_decay))


def make_train_step(cfg: ModelConfig, tx: optax.GradientTransformation) -> Callable:
    """A jitted step(params, opt_state, x, y) -> (params, opt_state, cross_entropy)."""

    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array):
        (_, ce), grads = jax.value_and_grad(loss, has_aux=True)(params, x, y, cfg)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ce

    return jax.jit(step)


def make_eval(cfg: ModelConfig) -> Callable:
    """A jitted eval(params, x, y) -> mean cross entropy in nats (bits per byte = nats / ln 2)."""
    return jax.jit(lambda params, x, y: loss(params, x, y, cfg)[1])


def make_choice_scorer(cfg: ModelConfig) -> Callable:
    """A jitted score(params, x, y, mask) -> (summed, per-byte) log-likelihood of each row's masked
    target bytes, float32[rows] each (rows as built by `data.choice_arrays`)."""

    def score(params: Any, x: jax.Array, y: jax.Array, mask: jax.Array):
        logits, _ = forward(params, x, cfg)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), y[..., None], axis=-1)[..., 0]
        summed = jnp.sum(logp * mask, axis=-1)
        return summed, summed / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)

    return jax.jit(score)


CHOICE_RANKINGS = ("pmi", "per_byte", "sum")


def make_choice_accuracy(
    cfg: ModelConfig,
    count: int = CHOICE_ITEMS,
    seed: int = 0,
    ranking: str = "pmi",
    items: list[data.ChoiceItem] | None = None,
) -> Callable[[Any], float]:
    """accuracy(params) -> share of `data.choice_items(count, cfg.seq, seed)` (or of `items`) where
    the true next line ranks first among the 4 options (chance 1/4).

    ranking "pmi" (the default, what the demo reports): log P(option | context) minus
    log P(option | a bare line break), i.e. how much the context raises the option's likelihood.
    A byte model of our size judges a line mostly by its own spelling, so a plain likelihood ranks
    lines that are easy to spell first whatever the context ("per_byte": the mean per byte, "sum":
    the total, which also favours short lines); both stay close to chance at demo scale, while "pmi"
    measures what the context contributes (Holtzman et al., "Surface Form Competition", 2021).
    """
    if ranking not in CHOICE_RANKINGS:
        raise ValueError(f"ranking must be one of {CHOICE_RANKINGS}, got {ranking!r}")
    items = items if items is not None else data.choice_items(count, cfg.seq, seed)
    x, y, mask, answers = data.choice_arrays(items, cfg.seq)
    bare = data.choice_arrays([data.ChoiceItem(b"\n", it.options, it.answer) for it in items], cfg.seq)
    score = make_choice_scorer(cfg)
    options = x.shape[0] // answers.size

    def accuracy(params: Any) -> float:
        summed, per_byte_ll = score(params, x, y, mask)
        if ranking == "pmi":
            ranked = summed - score(params, *bare[:3])[0]
        else:
            ranked = per_byte_ll if ranking == "per_byte" else summed
        return float(jnp.mean(jnp.argmax(ranked.reshape(answers.size, options), axis=-1) == answers))

    return accuracy


def enable_compilation_cache(directory: str | os.PathLike | None = None) -> Path:
    """Turn on JAX's persistent compilation cache (jitted steps compile once per machine)."""
    path = Path(directory or Path.home() / ".cache" / "ddiloco" / "jax")
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path
