"""`ddiloco syncer` as a user runs it: a real process, its log, its HTTP endpoints, SIGTERM."""

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest


def test_syncer_process_serves_and_stops_on_sigterm(tmp_path, start_syncer):
    proc, port, lines = start_syncer(tmp_path, "--quorum", "2", "--fragments", "3")
    try:
        first = json.loads(lines[0].split("config ", 1)[1])  # the effective config is the first log line
        assert first["quorum"] == 2 and first["fragments"] == 3 and first["period"] == 4  # the core's default
        assert first["sources"]["quorum"] == "flag --quorum" and "period" not in first["sources"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            assert json.loads(r.read())["status"] == "ok"
        status = subprocess.run(
            [sys.executable, "-m", "ddiloco.cli", "status", f"http://127.0.0.1:{port}", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0 and json.loads(status.stdout)["config"]["quorum"] == 2
        req = urllib.request.Request(f"http://127.0.0.1:{port}/checkpoint", method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=5)
        assert info.value.code == 401  # changing state needs the token
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--quorum", "0"], "quorum must be an integer"),
        (["--merge", "median"], "invalid choice"),
        (["--resume", "does-not-exist"], "cannot resume"),
    ],
)
def test_bad_flags_get_one_clear_line(tmp_path, args, message):
    out = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", "syncer", *args], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def _env(**variables):
    """This process's environment without any DDILOCO_* variable, plus `variables`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDILOCO_")}
    return {**env, **variables}


def test_flags_win_over_environment_over_file_and_the_first_line_says_where_each_value_came_from(
    tmp_path, start_syncer
):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "syncer.toml").write_text('quorum = 3\nfragments = 5\nperiod = 6\nsnapshot_dir = "snaps"\noverlap = 3\n')
    env = _env(DDILOCO_CONFIG=str(conf / "syncer.toml"), DDILOCO_FRAGMENTS="2", DDILOCO_PERIOD="7")
    proc, _, lines = start_syncer(tmp_path, "--period", "8", env=env)
    try:
        assert lines[0].split(": ", 1)[1].startswith("config {")
        first = json.loads(lines[0].split("config ", 1)[1])
        assert (first["quorum"], first["fragments"], first["period"], first["overlap"]) == (3, 2, 8, 3)
        assert first["snapshot_dir"] == str(conf / "snaps")  # relative to the file, not the working directory
        file = f"file {conf / 'syncer.toml'}"
        assert first["sources"] == {
            "config": "env DDILOCO_CONFIG",
            "quorum": file,
            "snapshot_dir": file,
            "overlap": file,
            "fragments": "env DDILOCO_FRAGMENTS",
            "period": "flag --period",
            "port": "flag --port",
            "auth_token_file": "flag --auth-token-file",
            "checkpoint_dir": "flag --checkpoint-dir",
        }
        with urllib.request.urlopen(f"http://127.0.0.1:{_port(lines)}/status", timeout=5) as r:
            config = json.loads(r.read())["config"]
        assert (config["quorum"], config["num_fragments"], config["period"], config["grace"]["overlap"]) == (3, 2, 8, 3)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def _port(lines):
    return int(lines[-1].rsplit(":", 1)[1])


def test_a_shared_token_file_is_accepted_with_allow_shared_token_and_a_warning_after_the_config(tmp_path, start_syncer):
    shared = tmp_path / "shared-token"
    shared.write_text("shared-token-0123456789abcdef\n")
    shared.chmod(0o640)
    proc, _, lines = start_syncer(tmp_path, "--auth-token-file", str(shared), "--allow-shared-token")
    try:
        assert " config {" in lines[0]
        assert json.loads(lines[0].split("config ", 1)[1])["allow_shared_token"] is True
        warnings = [line for line in lines if "WARNING" in line]
        assert len(warnings) == 1 and "readable by group (mode 0640)" in warnings[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def _refusal(tmp_path, args, env=None, toml=None):
    if toml is not None:
        (tmp_path / "syncer.toml").write_text(toml)
        args = ["--config", "syncer.toml", *args]
    out = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", "syncer", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=_env(**(env or {})),
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    return out.stderr


@pytest.mark.parametrize(
    "toml, env, message",
    [
        ("quorom = 2\n", {}, "unknown key 'quorom' in syncer.toml; known: ["),
        ('auth-token-file = "token"\n', {}, "did you mean 'auth_token_file'?"),
        ('port = "8470"\n', {}, "port in syncer.toml: expected an integer, got str '8470'"),
        ("port = 70000\n", {}, "port in syncer.toml: 70000 is outside [0, 65535]"),
        ('merge = "median"\n', {}, "merge in syncer.toml: 'median' is not one of ['rda', 'mean']"),
        ("quorum = 0\n", {}, "quorum must be an integer in [1, 256], got 0 (quorum from file syncer.toml)"),
        ('config = "other.toml"\n', {}, "config in syncer.toml: not allowed in a config file"),
        ("[syncer]\nquorum = 2\n", {}, "no tables; found table 'syncer'"),
        ("quorum = \n", {}, "syncer.toml is not valid TOML"),
        (None, {"DDILOCO_QUORUM": "two"}, "quorum from env DDILOCO_QUORUM: expected an integer, got 'two'"),
        (None, {"DDILOCO_QOURUM": "2"}, "unknown environment variable DDILOCO_QOURUM"),
        (
            None,
            {"DDILOCO_INSECURE_NO_AUTH": "maybe"},
            "insecure_no_auth from env DDILOCO_INSECURE_NO_AUTH: expected one of",
        ),
        (None, {"DDILOCO_CONFIG": "missing.toml"}, "cannot read config file missing.toml"),
        (
            None,
            {"DDILOCO_SHARD": "2", "DDILOCO_SHARDS": "2"},
            "shard index must lie in [0, 1] for 2 shards, got 2 (shard from env DDILOCO_SHARD)",
        ),
        (
            "shards = 5\nfragments = 4\n",
            {},
            "5 shards need at least 5 fragments, the syncer has 4 (shards from file syncer.toml)",
        ),
    ],
)
def test_unknown_keys_and_bad_values_are_refused_naming_the_key_and_its_source(tmp_path, toml, env, message):
    assert message in _refusal(tmp_path, [], env=env, toml=toml)


@pytest.mark.parametrize(
    "mode, token, args, message",
    [
        (0o644, "a-strong-enough-token-0123456789", [], "readable by group and others (mode 0644): run `chmod 600"),
        (0o604, "a-strong-enough-token-0123456789", [], "readable by others (mode 0604)"),
        (0o600, "a" * 16, [], "only 1 distinct characters"),
        (0o600, "0123456789abcdef" * 2, [], "estimated 64 bits of entropy, fewer than 128"),
        (0o600, "0a1b2c3d4e5f6a7b", [], "estimated 64 bits of entropy, fewer than 128"),
    ],
)
def test_weak_or_shared_tokens_are_refused(tmp_path, mode, token, args, message):
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / "token").chmod(mode)
    assert message in _refusal(tmp_path, ["--auth-token-file", "token", *args])


def test_no_token_on_an_address_others_can_reach_is_refused_unless_insecure_no_auth(tmp_path):
    assert "pass --insecure-no-auth" in _refusal(tmp_path, ["--host", "0.0.0.0"])
    assert "pass --insecure-no-auth" in _refusal(tmp_path, [], env={"DDILOCO_HOST": "::"})


def test_the_readme_token_command_makes_a_token_the_syncer_accepts(tmp_path):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("## The syncer daemon", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    making = [line for line in block.splitlines() if "token" in line and not line.startswith("ddiloco ")]
    assert any("secrets.token_hex(16)" in line for line in making) and any("chmod 600 token" in line for line in making)
    subprocess.run(
        ["bash", "-euc", "\n".join(making).replace("python ", f"{sys.executable} ")], cwd=tmp_path, check=True
    )
    from ddiloco.net.auth import read_token_file

    assert len(read_token_file(tmp_path / "token")) == 32


def test_a_fresh_run_refuses_another_runs_checkpoint_dir_unless_told(tmp_path, start_syncer, another_runs_checkpoint):
    old = another_runs_checkpoint(tmp_path / "ck")
    out = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", "syncer", "--port", "0", "--checkpoint-dir", str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "holds checkpoints of another run: run aaaaaaaaaaaaaaaa" in out.stderr and "--overwrite" in out.stderr
    proc, _, lines = start_syncer(tmp_path, "--overwrite")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    # no parameters, so no checkpoint of the new run: the old run's stays until one is written
    assert old.exists()


def test_resume_continues_the_same_run(tmp_path, start_syncer, another_runs_checkpoint):
    from ddiloco.net import store

    old = another_runs_checkpoint(tmp_path / "ck")
    proc, _, lines = start_syncer(tmp_path, "--resume", str(tmp_path / "ck"))
    assert any("checkpoints of run aaaaaaaaaaaaaaaa" in line for line in lines)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0  # with a last checkpoint, of the same run
    state, newest = store.newest_valid(tmp_path / "ck")
    assert newest != old and store.run_of(newest) == "aaaaaaaaaaaaaaaa" and state.merges == 500


def test_tls_syncer_serves_https_and_status_needs_the_ca(tmp_path, start_syncer, self_signed_cert):
    cert, key = self_signed_cert
    proc, port, lines = start_syncer(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        assert "(TLS: https, wss)" in lines[-1]
        assert json.loads(lines[0].split("config ", 1)[1])["sources"]["tls_cert"] == "flag --tls-cert"
        url = f"https://127.0.0.1:{port}"
        status = subprocess.run(
            [sys.executable, "-m", "ddiloco.cli", "status", url, "--json", "--tls-ca", str(cert)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["merges"] == 0
        untrusted = subprocess.run(
            [sys.executable, "-m", "ddiloco.cli", "status", url],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert untrusted.returncode == 1 and "Traceback" not in untrusted.stderr
        assert f"the certificate of {url} is not trusted by the system's CAs (give --tls-ca FILE)" in untrusted.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


@pytest.mark.parametrize(
    "which, message",
    [
        ("cert only", "tls_cert and tls_key go together: give both or neither"),
        ("missing key", "cannot read the TLS key missing.key: No such file or directory"),
        ("swapped", "cannot be used together"),
    ],
)
def test_bad_tls_files_get_one_clear_line(tmp_path, self_signed_cert, which, message):
    cert, key = self_signed_cert
    args = {
        "cert only": ["--tls-cert", str(cert)],
        "missing key": ["--tls-cert", str(cert), "--tls-key", "missing.key"],
        "swapped": ["--tls-cert", str(key), "--tls-key", str(cert)],
    }[which]
    assert message in _refusal(tmp_path, args)


def test_a_shard_says_which_it_is_in_its_first_line_and_its_status(tmp_path, start_syncer):
    proc, port, lines = start_syncer(tmp_path, "--shard", "1", "--shards", "2", "--fragments", "4")
    try:
        first = json.loads(lines[0].split("config ", 1)[1])
        assert (first["shard"], first["shards"]) == (1, 2)
        assert first["sources"]["shard"] == "flag --shard" and first["sources"]["shards"] == "flag --shards"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as r:
            status = json.loads(r.read())
        assert (status["shard"], status["shards"], status["owned"]) == (1, 2, [1, 3])
        assert [f["index"] for f in status["fragments"]] == [1, 3]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def _shard_checkpoint(directory, shard, shards):
    """A checkpoint of shard `shard` of `shards` (four small fragments) written into `directory`."""
    import numpy as np

    from ddiloco.core import syncer
    from ddiloco.core.config import SyncerConfig
    from ddiloco.core.layout import TensorSpec, build_layout
    from ddiloco.net import store

    layout = build_layout([TensorSpec(f"w{i}", (4, 8)) for i in range(4)], 4)
    config = SyncerConfig(num_fragments=4, shard=shard, shards=shards)
    state = syncer.new_state(config, layout, [np.ones(f.padded_size, np.float32) for f in layout.fragments])
    return store.CheckpointStore.open(directory).write(state).path


def test_resuming_another_shards_checkpoint_is_refused_naming_both(tmp_path, start_syncer):
    _shard_checkpoint(tmp_path / "ck", 1, 2)
    stderr = _refusal(tmp_path, ["--resume", "ck", "--shard", "0", "--shards", "2"])
    assert "the checkpoint is of shard 1 of 2, the configuration is shard 0 of 2" in stderr
    assert "the configuration is shard 0 of 1" in _refusal(tmp_path, ["--resume", "ck"])
    # A standby checks the same as soon as the directory has a checkpoint, before it waits to take over.
    standby = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", "syncer", "--standby", "--resume", "ck", "--shards", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=_env(),
    )
    assert standby.returncode == 2 and "Traceback" not in standby.stderr
    last = standby.stderr.strip().splitlines()[-1]
    assert "cannot stand by for ck: the checkpoint is of shard 1 of 2, the configuration is shard 0 of 2" in last
    assert "took over" not in standby.stderr
    proc, _, lines = start_syncer(tmp_path, "--resume", str(tmp_path / "ck"), "--shard", "1", "--shards", "2")
    try:
        assert not any("not applied" in line for line in lines)  # the shard is checked, not ignored
        assert json.loads(lines[0].split("config ", 1)[1])["shard"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
