"""A flax linen model trained as one Decoupled DiLoCo learner; then the merged model exported and loaded.

Start a syncer that writes checkpoints (docs/getting-started.md), then run one or more learners,
each with its own name:

    ddiloco syncer --auth-token-file token --checkpoint-dir ckpt --fragments 2 --outer-lr 1 --outer-momentum 0
    python examples/flax_linen.py --name linen-0 --token-file token --checkpoint-dir ckpt

The task is a small regression every learner shares (the same teacher, each learner its own samples).
"""

import argparse
import zlib
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddiloco.errors import reported_as_exit
from ddiloco.learner.params_file import export, load_params
from ddiloco.learner.sync import DilocoSync, SyncConfig
from ddiloco.net.control import request_checkpoint

FEATURES = 8


class MLP(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(self.width)(x))
        x = nn.gelu(nn.Dense(self.width)(x))
        return nn.Dense(1)(x)[..., 0]


def batches(seed, batch):
    teacher = np.random.default_rng(0).standard_normal(FEATURES)
    rng = np.random.default_rng(seed)
    while True:
        x = rng.standard_normal((batch, FEATURES)).astype(np.float32)
        yield x, np.sin(x @ teacher).astype(np.float32)


def main():
    p = argparse.ArgumentParser(description="one learner of a flax linen model")
    p.add_argument("--url", default="ws://127.0.0.1:8470/ws", help="the syncer's websocket")
    p.add_argument("--name", default="linen-0")
    p.add_argument("--token-file", type=Path, required=True)
    p.add_argument("--steps", type=int, default=500)
    # Big enough for steps of milliseconds on a CPU: a loop much faster than that outruns the syncer's rounds.
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--checkpoint-dir", type=Path, help="the syncer's: checkpoint and export its model at the end")
    p.add_argument("--out", type=Path, default=Path("linen.safetensors"))
    args = p.parse_args()

    model = MLP(args.width)
    data = batches(zlib.crc32(args.name.encode()), args.batch)
    x_eval, y_eval = next(batches(zlib.crc32(b"held-out"), batch=1024))
    params = model.init(jax.random.PRNGKey(0), x_eval)["params"]
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    def loss_fn(params, x, y):
        return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    train_step(params, opt_state, *next(data))  # compile before joining (docs/learner.md)
    print(f"initial loss {loss_fn(params, x_eval, y_eval):.4f}")

    # The hook: three lines.
    token = args.token_file.read_text().strip()
    sync = DilocoSync(params, SyncConfig(url=args.url, name=args.name, token=token))
    for _ in range(args.steps):
        x, y = next(data)
        params, opt_state, loss = train_step(params, opt_state, x, y)
        params = sync.step(params, tokens=len(x))
    sync.close()
    print(f"learner {args.name}: {args.steps} steps, last training loss {loss:.4f}")

    if args.checkpoint_dir is not None:
        request_checkpoint(args.url, token)  # the syncer's parameters now, on disk
        export(args.checkpoint_dir, args.out, "safetensors")  # what `ddiloco export` does
        merged = load_params(args.out, like=params)
        print(f"exported model {args.out}: loss {loss_fn(merged, x_eval, y_eval):.4f}")


if __name__ == "__main__":
    with reported_as_exit(Path(__file__).name):  # a refusal or a fault: one line, not a traceback
        main()
