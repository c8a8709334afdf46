"""A learner whose parameters are sharded over several JAX devices, with the sync hook, on the CPU.

JAX fixes its device count when its backend first starts, and this pytest process has one CPU device,
so the sharded part runs in a child Python started on this same file with four forced host devices
(`python test_sharded.py` runs `main`). The child checks, and prints one JSON line:

- `TreeFragments.gather` returns the host values of sharded leaves, and `scatter` (alpha 0 and
  alpha > 0) puts new values back on each leaf's own sharding and dtype, committed or not;
- a real syncer daemon on 127.0.0.1 and a `DilocoSync` over sharded params: fragments merge and are
  applied, and the params `sync.step` returns keep their shardings (so the jitted step never
  compiles again);
- `recovery.snapshot_bytes` and `recovery.adopt` put params and optimizer state back on the local
  leaves' shardings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ddiloco.core.config import SyncerConfig
from ddiloco.core.layout import build_layout
from ddiloco.learner import recovery
from ddiloco.learner.sync import DilocoSync, SyncConfig
from ddiloco.learner.tree import TreeFragments, leaf_path, tensor_specs
from ddiloco.net import peer

DEVICES = 4
CHILD_TIMEOUT_S = 180  # ~10 s on 2 shared cores; generous for a loaded machine
MERGE_DEADLINE_S = 90
RESULT_PREFIX = "SHARDED-RESULT "


# ---- the pytest side -------------------------------------------------------------------------------


def run_child() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    assert proc.returncode == 0 and lines, (
        f"the sharded child exited {proc.returncode} without a result\n"
        f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    )
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def test_sharded_params_keep_their_shardings_through_sync_and_recovery():
    result = run_child()
    assert result["devices"] == DEVICES, (
        f"the child saw {result['devices']} devices, not {DEVICES}: XLA_FLAGS not applied"
    )
    failures = result["failures"]
    assert not failures, f"{len(failures)} sharded learner checks failed:\n" + "\n".join(failures[:20])
    assert result["merged_versions_applied"] > 0, f"no merged fragment was applied: {result}"
    assert result["merges"] > 0, f"the syncer merged nothing: {result}"
    assert result["sharded_leaves"] >= 3, f"too few leaves were actually sharded: {result}"


# ---- the child: four CPU devices -------------------------------------------------------------------


class Checks:
    """Failure messages collected in the child: every check runs, and the parent shows them all."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def that(self, ok: bool, message: str) -> None:
        if not ok:
            self.failures.append(message)


SPECS = {  # leaf name -> (shape, dtype, partition spec over the mesh axis "x")
    "embed": ((16, 8), "float32", ("x", None)),
    "blocks/w1": ((8, 16), "float32", (None, "x")),
    "blocks/w2": ((8, 8), "float32", ()),  # replicated over the mesh
    "head": ((8, 4), "bfloat16", ("x", None)),
}


def make_params(seed: int, committed: bool = True) -> dict:
    """A small params pytree on a 4-device mesh; `committed=False` leaves the replicated leaf as a
    freshly initialised one (uncommitted), the other branch of `tree.put_all_like`."""
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("x",))
    rng = np.random.default_rng(seed)

    def leaf(name: str) -> Any:
        shape, dtype, spec = SPECS[name]
        value = jnp.asarray(rng.standard_normal(shape), dtype=dtype)
        if not committed and spec == ():
            return value
        return jax.device_put(value, NamedSharding(mesh, PartitionSpec(*spec)))

    return {"embed": leaf("embed"), "blocks": {"w1": leaf("blocks/w1"), "w2": leaf("blocks/w2")}, "head": leaf("head")}


def named_leaves(tree: Any) -> list[tuple[str, Any]]:
    return [(leaf_path(keys), leaf) for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def same_placement(new: Any, old: Any) -> bool:
    """The same sharding (equal, not merely equivalent: jit's cache key tells P("x", None) from
    P("x")), dtype and committed-ness, so equal placements mean the step does not compile again."""
    return (
        new.dtype == old.dtype
        and new.shape == old.shape
        and new.sharding == old.sharding
        and new.committed == old.committed
    )


def check_placements(checks: Checks, what: str, new: Any, old: Any) -> None:
    for (path, a), (_, b) in zip(named_leaves(new), named_leaves(old)):
        checks.that(
            same_placement(a, b),
            f"{what}: leaf {path} is {a.dtype} on {a.sharding} (committed {a.committed}), "
            f"was {b.dtype} on {b.sharding} (committed {b.committed})",
        )


def check_tree(checks: Checks, committed: bool) -> None:
    """gather is exact on sharded leaves; scatter keeps shardings and dtypes and writes the values."""
    params = make_params(0, committed)
    layout = build_layout(tensor_specs(params), 2)
    tree = TreeFragments(params, layout)
    host = {path: np.asarray(jax.device_get(leaf), dtype=np.float32) for path, leaf in named_leaves(params)}
    tag = f"tree (committed={committed})"
    for p, frag in enumerate(layout.fragments):
        got = tree.gather(params, p)
        for seg in frag.segments:
            want = host[seg.tensor.path].reshape(-1)
            checks.that(
                np.array_equal(got[seg.offset : seg.offset + seg.tensor.size], want),
                f"{tag}: gather of fragment {p} differs from the host value of {seg.tensor.path}",
            )
        # placed on another thread (as learner.background does), then added: the bits and the
        # placements of `add`
        values = (got * 0.5).astype(np.float32)
        with ThreadPoolExecutor(1) as other:
            placed = other.submit(tree.place, p, tree.placement(params, p), values).result()
        checks.that(tree.fits(params, p, placed), f"{tag}: values placed for fragment {p} do not fit its leaves")
        added, want_added = tree.add_placed(params, p, placed), tree.add(params, p, values)
        check_placements(checks, f"{tag}: add_placed of fragment {p}", added, params)
        for (path, a), (_, b) in zip(named_leaves(added), named_leaves(want_added)):
            checks.that(
                np.array_equal(np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))),
                f"{tag}: add_placed of fragment {p} differs from add in {path}",
            )
        check_one_by_one(checks, f"{tag}: fragment {p}", tree, params, added, p, placed)
        for alpha in (0.0, 0.25):
            values = (got + 1.0).astype(np.float32)
            new = tree.scatter(params, p, values, alpha)
            check_placements(checks, f"{tag}: scatter(alpha={alpha}) of fragment {p}", new, params)
            new_host = {path: np.asarray(jax.device_get(leaf), dtype=np.float32) for path, leaf in named_leaves(new)}
            for seg in frag.segments:
                path, dtype = seg.tensor.path, SPECS[seg.tensor.path][1]
                want = alpha * host[path] + (1 - alpha) * values[seg.offset : seg.offset + seg.tensor.size].reshape(
                    host[path].shape
                )
                want = np.asarray(want.astype(dtype), dtype=np.float32)  # rounded as the leaf's dtype is
                checks.that(
                    np.array_equal(new_host[path], want),
                    f"{tag}: scatter(alpha={alpha}) wrote wrong values into {path}",
                )


def check_one_by_one(
    checks: Checks, tag: str, tree: TreeFragments, params: Any, added: Any, p: int, placed: list
) -> None:
    """`add_placed` gives the bits and placements of adding fragment p's leaves one by one, eagerly
    (it adds them as one program where it can)."""
    for old, new, add in zip(tree.leaves(params, p), tree.leaves(added, p), placed, strict=True):
        want = old + add
        checks.that(
            same_placement(new, want), f"{tag}: a leaf added as one program is on {new.sharding}, not {want.sharding}"
        )
        checks.that(
            np.array_equal(np.asarray(jax.device_get(new)), np.asarray(jax.device_get(want))),
            f"{tag}: a leaf added as one program differs from its eager add",
        )


def check_spread(checks: Checks) -> None:
    """A fragment whose leaves live on different devices (as in a pipeline) cannot be added as one
    program: each leaf is added where it is, and stays there."""
    devices = jax.devices()[:2]
    params = {
        "a": jax.device_put(jnp.arange(64, dtype=jnp.float32), devices[0]),
        "b": jax.device_put(jnp.ones((4, 8), jnp.bfloat16), devices[1]),
    }
    tree = TreeFragments(params, build_layout(tensor_specs(params), 1))
    values = np.linspace(-1, 1, tree.layout.fragments[0].padded_size, dtype=np.float32)
    placed = tree.place(0, tree.placement(params, 0), values)
    added = tree.add_placed(params, 0, placed)
    check_placements(checks, "leaves on two devices: add_placed", added, params)
    check_one_by_one(checks, "leaves on two devices", tree, params, added, 0, placed)


def check_sync_and_recovery(checks: Checks, result: dict) -> None:
    params = make_params(1)
    update = jax.jit(lambda ps: jax.tree.map(lambda x: (x - 0.01).astype(x.dtype), ps))
    # Compile before joining (docs/learner.md). Twice: jit returns P("x", None) spelled P("x"), so
    # its own outputs are a second cache entry; from then on the placements are fixed.
    params = update(update(params))
    cache_size = getattr(update, "_cache_size", lambda: -1)  # jax's private counter; -1: not there
    original, compiled = params, cache_size()
    # The child runs this file as a script, so this directory is on its path (pytest's importlib mode
    # does not put it there for the parent, which never gets here).
    from conftest import TOKEN, ThreadedSyncer

    daemon = ThreadedSyncer(SyncerConfig(num_fragments=2, period=2, quorum=1))
    sync = DilocoSync.connect(params, SyncConfig(url=daemon.url, name="sharded", token=TOKEN))
    try:
        deadline, steps = time.monotonic() + MERGE_DEADLINE_S, 0
        # Train until the learner has applied merged versions of both fragments (not a step count:
        # the network runs on the client's thread and a loaded machine is slower).
        while (sync.merged_versions_applied < 2 or min(sync.versions) < 1) and time.monotonic() < deadline:
            params = sync.step(update(params), tokens=64)
            steps += 1
            time.sleep(0.005)
        result |= {
            "steps": steps,
            "merged_versions_applied": sync.merged_versions_applied,
            "versions": list(sync.versions),
            "merges": daemon.read(lambda state: state.merges),
        }
        check_placements(checks, "params after sync.step", params, original)
        finite = all(
            bool(np.isfinite(np.asarray(jax.device_get(x), dtype=np.float32)).all()) for x in jax.tree.leaves(params)
        )
        checks.that(finite, "params after sync.step hold non-finite values")
        # Applied fragments must not move a leaf: a moved leaf is a new cache entry (a recompile).
        result["jit_cache_size"] = cache_size()
        checks.that(
            cache_size() == compiled,
            f"the jitted step compiled again during sync ({compiled} -> {cache_size()} cache entries)",
        )

        opt_state = optax.adam(1e-3).init(params)
        data = recovery.snapshot_bytes(params, opt_state, sync.step_count, sync.versions, sync.layout.digest)
        local_params = make_params(2)  # another learner's fresh state on the same mesh
        local_opt = optax.adam(1e-3).init(local_params)
        new_params, new_opt, step, versions = recovery.adopt(
            peer.decode_snapshot(data), local_params, local_opt, sync.layout.digest, tuple(sync.versions)
        )
        check_placements(checks, "adopted params", new_params, local_params)
        check_placements(checks, "adopted optimizer state", new_opt, local_opt)
        checks.that(
            step == sync.step_count and list(versions) == list(sync.versions),
            f"adopted step/versions {step}/{list(versions)}, snapshot had {sync.step_count}/{sync.versions}",
        )
        for (path, a), (_, b) in zip(named_leaves(new_params), named_leaves(params)):
            checks.that(
                np.array_equal(np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))),
                f"adopted params: {path} is not the snapshot's value",
            )
    finally:
        sync.close()
        daemon.stop()


def main() -> None:
    checks = Checks()
    result: dict = {"devices": len(jax.devices())}
    params = make_params(0)
    result["sharded_leaves"] = sum(
        len(leaf.sharding.device_set) == DEVICES and not leaf.sharding.is_fully_replicated
        for _, leaf in named_leaves(params)
    )
    started = time.monotonic()
    if result["devices"] == DEVICES:
        check_tree(checks, committed=True)
        check_tree(checks, committed=False)
        check_spread(checks)
        check_sync_and_recovery(checks, result)
    result["seconds"] = round(time.monotonic() - started, 2)
    result["failures"] = checks.failures
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
