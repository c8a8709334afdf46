"""learner.lead: the newest step the devices have computed, asked of real JAX arrays on the CPU
(JAX dispatches there asynchronously too), and TreeFragments.probe, the array it asks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddiloco.core.layout import build_layout
from ddiloco.learner import lead
from ddiloco.learner.lead import DispatchLead
from ddiloco.learner.tree import TreeFragments, tensor_specs

# One step of a few hundred milliseconds on 2 cores: a call right after its dispatch finds it not
# computed, however loaded the machine.
SLOW_ITERATIONS = 300


def _slow(x):
    return jax.lax.fori_loop(0, SLOW_ITERATIONS, lambda i, y: jnp.tanh(y @ y), x)


slow_step = jax.jit(_slow)
slow_donating_step = jax.jit(_slow, donate_argnums=0)


def _start() -> jax.Array:
    x = jnp.full((256, 256), 1 / 256, dtype=jnp.float32)
    slow_step(x).block_until_ready()  # compiled: a dispatch from here on returns at once
    slow_donating_step(jnp.array(x)).block_until_ready()
    return x


def test_a_loop_that_runs_ahead_reports_the_step_its_devices_finished():
    x, counted = _start(), DispatchLead(10)
    seen = []
    for step in (11, 12, 13):
        x = slow_step(x)
        seen.append(counted.dispatched(step, x))
    assert seen == [10, 10, 10] and counted.pending == 3  # none computed at its call
    x.block_until_ready()  # the loop reads its loss, say
    assert counted.dispatched(14, x) == 14 and counted.pending == 0


def test_a_probe_donated_to_the_next_step_says_nothing_and_the_newest_does():
    x, counted = _start(), DispatchLead(0)
    x = slow_donating_step(jnp.array(x))
    assert counted.dispatched(1, x) == 0
    x2 = slow_donating_step(x)  # x is donated: deleted, its own step's end unknown
    assert x.is_deleted() and counted.dispatched(2, x2) == 0 and counted.pending == 1
    x2.block_until_ready()
    assert counted.dispatched(3, x2) == 3


def test_host_values_are_computed_at_their_call():
    counted = DispatchLead(5)
    assert counted.dispatched(6, None) == 6 and counted.pending == 0


def test_a_loop_further_ahead_than_the_limit_counts_the_oldest_computed(monkeypatch):
    monkeypatch.setattr(lead, "LEAD_STEPS_MAX", 2)
    x, counted = _start(), DispatchLead(0)
    got = []
    for step in (1, 2, 3, 4):
        x = slow_step(x)
        got.append(counted.dispatched(step, x))
    assert got == [0, 0, 1, 2] and counted.pending == 2
    x.block_until_ready()


@dataclasses.dataclass
class _Module:  # attributes, as an equinox module's fields are reached
    w: object
    b: object


jax.tree_util.register_dataclass(_Module, data_fields=["w", "b"], meta_fields=[])


@pytest.mark.parametrize(
    "params",
    [
        {"b": {"z": jnp.ones(3)}, "a": [jnp.zeros(2), jnp.ones(4)]},
        [{"w": jnp.ones((2, 2))}, jnp.zeros(3)],
        {"layer": _Module(jnp.ones(5), jnp.zeros(5))},
    ],
)
def test_the_probe_is_the_first_leaf_found_by_its_path(params):
    tree = TreeFragments(params, build_layout(tensor_specs(params), 1))
    first = jax.tree_util.tree_leaves(params)[0]
    assert tree.probe(params) is first
    moved = jax.tree_util.tree_map(lambda v: v + 1, params)  # the next step's values, same structure
    assert tree.probe(moved) is jax.tree_util.tree_leaves(moved)[0]


def test_host_leaves_have_no_probe():
    params = {"a": np.ones(4, np.float32), "b": np.zeros(2, np.float32)}
    tree = TreeFragments(params, build_layout(tensor_specs(params), 1))
    assert tree.probe(params) is None
    # the type remembered from a device leaf (the probe's shortcut) passes nothing else through
    device = {"a": jnp.ones(4), "b": jnp.zeros(2)}
    tree = TreeFragments(device, build_layout(tensor_specs(device), 1))
    assert tree.probe(device) is device["a"]
    assert tree.probe(params) is None and tree.probe({"b": device["b"]}) is None


def test_steps_noted_without_asking_are_asked_about_at_the_next_report():
    # a hook call that only counts notes its step's probe (learner.sync._counts_only); the next
    # report finds every noted step that is computed, the newest included
    x, counted = _start(), DispatchLead(10)
    probes = []
    for step in (11, 12, 13):
        x = slow_step(x)
        probes.append(x)
        counted.note(step, x)
    assert counted.computed == 10 and counted.pending == 3  # nothing asked yet
    jax.block_until_ready(probes)
    assert counted.dispatched(14, probes[-1]) == 14 and counted.pending == 0
    for step in range(15, 15 + lead.LEAD_STEPS_MAX + 2):
        counted.note(step, x)  # bounded like dispatched: the oldest is taken as computed
    assert counted.pending == lead.LEAD_STEPS_MAX and counted.computed == 16


def test_warming_a_fragments_device_add_compiles_what_its_first_apply_runs():
    # TreeFragments.warm_add, on any thread ahead of the first version added: the apply on the
    # training thread then finds the add compiled (no entry added to the jit's cache).
    from ddiloco.learner import tree as trees

    params = {"a": jnp.ones((24, 40)), "b": jnp.ones((40, 8)), "c": jnp.ones((13,))}
    tree = TreeFragments(params, build_layout(tensor_specs(params), 1))
    placement = tree.placement(params, 0)
    before = trees._added._cache_size()
    tree.warm_add(placement)
    warmed = trees._added._cache_size()
    assert warmed == before + 1
    values = np.arange(tree.layout.fragments[0].padded_size, dtype=np.float32)
    added = tree.add_placed(params, 0, tree.place(0, placement, values))
    assert trees._added._cache_size() == warmed
    assert float(added["c"][0]) == 1.0 + values[24 * 40 + 40 * 8]
