"""The trained model out of a checkpoint: `ddiloco export` in a real process, read back by safetensors,
numpy and orbax themselves and by `load_params` into a pytree."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file

from ddiloco.core import syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.layout import build_layout
from ddiloco.learner import params_file
from ddiloco.learner.params_file import ParamsFileError, load_params
from ddiloco.learner.tree import TreeFragments, tensor_specs
from ddiloco.net import store


def _params(seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    return {
        "embed": jax.random.normal(keys[0], (11, 4)),
        "blocks": [
            {"w": jax.random.normal(keys[1], (4, 4)), "b": jax.random.normal(keys[2], (4,))},
            {"w": jax.random.normal(keys[3], (4, 4)).astype(jnp.bfloat16), "b": jnp.zeros((4,))},
        ],
        "head": {"scale": jax.random.normal(keys[4], ())},
    }


RUN = "0123456789abcdef"


def _checkpoint(directory, params, merges):
    """A checkpoint of a syncer holding `params`, through the store as the daemon writes it."""
    layout = build_layout(tensor_specs(params), 3, block=8)
    tree = TreeFragments(params, layout)
    state = syncer.new_state(SyncerConfig(num_fragments=3, block=8), layout, [tree.gather(params, q) for q in range(3)])
    state.merges, state.global_step = merges, 10 * merges
    # One run writes them all, as one syncer does.
    return (
        store.CheckpointStore.open(directory, RUN if directory.exists() else None, new_id=lambda: RUN).write(state).path
    )


def _export(source, out, fmt):
    (got,) = _exports([(source, out, fmt)])
    return got


def _exports(jobs):
    """`ddiloco export` for each (source, out, fmt), the processes side by side (each start imports
    JAX for seconds); their results in order."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ddiloco.cli", "export", str(source), "--format", fmt, "--out", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for source, out, fmt in jobs
    ]
    done = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=120)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:  # one that timed out leaves none of the others running
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def _flat(params):
    return {
        "embed": params["embed"],
        "blocks/0/w": params["blocks"][0]["w"],
        "blocks/0/b": params["blocks"][0]["b"],
        "blocks/1/w": params["blocks"][1]["w"],
        "blocks/1/b": params["blocks"][1]["b"],
        "head/scale": params["head"]["scale"],
    }


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The newest of two checkpoints, exported in every format by the command."""
    work = tmp_path_factory.mktemp("export")
    _checkpoint(work / "ck", _params(0), merges=1)
    _checkpoint(work / "ck", _params(1), merges=2)  # the newest: its parameters are the ones exported
    outs = {"safetensors": work / "model.safetensors", "npz": work / "model.npz", "orbax": work / "model.orbax"}
    for got in _exports([(work / "ck", out, fmt) for fmt, out in outs.items()]):
        assert got.returncode == 0, got.stderr
        assert "wrote 6 tensors (" in got.stdout and "merge 2, global step 20" in got.stdout
    return outs


def test_each_format_reads_back_with_its_own_library_equal_to_the_checkpointed_parameters(exported):
    want = {k: np.asarray(v, dtype=np.float32) for k, v in _flat(_params(1)).items()}
    by_library = {
        "safetensors": load_file(exported["safetensors"]),
        "npz": dict(np.load(exported["npz"], allow_pickle=False)),
    }
    with ocp.StandardCheckpointer() as ckpt:
        tree = ckpt.restore(exported["orbax"].resolve())
    by_library["orbax"] = {
        "embed": tree["embed"],
        "head/scale": tree["head"]["scale"],
        **{f"blocks/{i}/{k}": tree["blocks"][str(i)][k] for i in (0, 1) for k in ("w", "b")},
    }
    for fmt, got in by_library.items():
        assert sorted(got) == sorted(want), fmt
        for name, value in want.items():
            assert got[name].dtype == np.float32 and got[name].shape == value.shape, (fmt, name)
            np.testing.assert_array_equal(got[name], value, err_msg=f"{fmt} {name}")


@pytest.mark.parametrize("fmt", ["safetensors", "npz", "orbax"])
def test_load_params_round_trips_into_the_users_pytree(exported, fmt):
    want = _params(1)
    like = jax.tree.map(jnp.zeros_like, want)
    got = load_params(exported[fmt], like=like)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert isinstance(g, jax.Array) and g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))  # bfloat16 through float32 is exact


def test_load_params_keeps_host_leaves_on_the_host(exported):
    like = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), _params(1))
    got = load_params(exported["npz"], like=like)
    assert all(type(leaf) is np.ndarray for leaf in jax.tree.leaves(got))


def test_a_given_checkpoint_file_is_exported_rather_than_the_newest(tmp_path):
    first = _checkpoint(tmp_path / "ck", _params(0), merges=1)
    _checkpoint(tmp_path / "ck", _params(1), merges=2)
    got = _export(first, tmp_path / "m.npz", "npz")
    assert got.returncode == 0 and "merge 1," in got.stdout
    np.testing.assert_array_equal(np.load(tmp_path / "m.npz")["embed"], np.asarray(_params(0)["embed"]))


def test_mismatching_pytrees_are_refused_naming_the_leaves(exported):
    params = _params(1)
    fewer = {k: v for k, v in params.items() if k != "head"}
    with pytest.raises(ParamsFileError, match=r"missing \[\], unexpected \['head/scale'\]"):
        load_params(exported["safetensors"], like=fewer)
    with pytest.raises(ParamsFileError, match=r"missing \['extra'\], unexpected \[\]"):
        load_params(exported["safetensors"], like={**params, "extra": jnp.zeros(2)})
    wider = {**params, "embed": jnp.zeros((12, 4))}
    with pytest.raises(ParamsFileError, match=r"embed: shape \(11, 4\) in the file, \(12, 4\) in the pytree"):
        load_params(exported["npz"], like=wider)
    ints = {**params, "embed": jnp.zeros((11, 4), jnp.int32)}
    with pytest.raises(ParamsFileError, match="embed: dtype float32 in the file, int32 in the pytree"):
        load_params(exported["orbax"], like=ints)


def test_bad_sources_and_targets_get_one_clear_line(tmp_path, exported):
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk").write_bytes(b"not a checkpoint at all, not even close")
    cases = [
        (tmp_path / "empty", tmp_path / "a.npz", "no checkpoint in"),
        (tmp_path / "junk", tmp_path / "a.npz", "not a ddiloco checkpoint"),
        (tmp_path / "missing", tmp_path / "a.npz", "cannot read checkpoint"),
        (exported["npz"].parent / "ck", exported["npz"], "already exists: give a new path"),
    ]
    for (_, _, message), got in zip(cases, _exports([(source, out, "npz") for source, out, _ in cases])):
        assert got.returncode == 2 and message in got.stderr and "Traceback" not in got.stderr, got.stderr
        assert len(got.stderr.strip().splitlines()) == 1
    with pytest.raises(ParamsFileError, match="neither an npz, a safetensors file nor an orbax directory"):
        params_file.read_params(tmp_path / "junk")
