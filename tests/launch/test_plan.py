"""`ddiloco.launch.plan`: a launch's settings are checked, and give the command lines they should."""

from pathlib import Path

import pytest

from ddiloco.launch.plan import (
    LaunchConfig,
    learner_argv,
    shard_checkpoint_dir,
    syncer_argv,
    syncer_log_name,
    syncer_urls,
)

TOKEN = "9f2c4e1ab7d05f3e8c6a1b9d2e7f4a03"


def config(**changes):
    base = {"learners": 3, "checkpoint_dir": Path("/ck"), "log_dir": Path("/logs"), "token": TOKEN}
    return LaunchConfig(**{**base, **changes})


def test_the_syncer_resumes_only_when_told_and_passes_its_own_arguments_through():
    c = config(syncer_args=("--fragments", "8"))
    fresh = syncer_argv(c, Path("/p/token"), resume=False)
    assert fresh == [
        "--host",
        "0.0.0.0",
        "--port",
        "8470",
        "--auth-token-file",
        "/p/token",
        "--checkpoint-dir",
        "/ck",
        "--fragments",
        "8",
    ]
    again = syncer_argv(c, Path("/p/token"), resume=True, tls_files=(Path("/p/c"), Path("/p/k")))
    assert again[6:8] == ["--resume", "/ck"] and again[8:12] == ["--tls-cert", "/p/c", "--tls-key", "/p/k"]


def test_each_learner_gets_its_shard_and_name_and_the_token_only_as_a_file():
    c = config(learner_args=("--steps", "50"))
    argv = learner_argv(c, 2, "wss://h:1/ws", Path("/p/token"), ca_file=Path("/p/ca"))
    assert argv == [
        "--syncer",
        "wss://h:1/ws",
        "--token-file",
        "/p/token",
        "--shard",
        "2/3",
        "--name",
        "learner-2",
        "--tls-ca",
        "/p/ca",
        "--steps",
        "50",
    ]
    assert TOKEN not in " ".join(argv) + " ".join(syncer_argv(c, Path("/p/token"), resume=False))
    assert TOKEN not in repr(c)
    with pytest.raises(ValueError, match=r"learner index must lie in \[0, 3\)"):
        learner_argv(c, 3, "ws://h:1/ws", Path("/t"))


@pytest.mark.parametrize(
    "changes, url, status",
    [
        ({}, "ws://10.0.0.7:8470/ws", "http://10.0.0.7:8470"),
        ({"host": "192.168.1.2", "port": 9000}, "ws://192.168.1.2:9000/ws", "http://192.168.1.2:9000"),
        ({"advertise_host": "syncer.example"}, "ws://syncer.example:8470/ws", "http://syncer.example:8470"),
        ({"host": "::", "tls_cert": b"c", "tls_key": b"k"}, "wss://[fd00::7]:8470/ws", "https://[fd00::7]:8470"),
    ],
)
def test_learners_dial_the_node_where_the_syncer_listens_on_every_interface(changes, url, status):
    node = "fd00::7" if changes.get("host") == "::" else "10.0.0.7"
    assert syncer_urls(config(**changes), node) == (url, status)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"learners": 0}, "learners must lie in"),
        ({"shards": 0}, r"shards must lie in \[1, 64\]"),
        ({"shards": 65}, r"shards must lie in \[1, 64\]"),
        ({"shards": 4, "port": 65533}, r"port must lie in \[1, 65532\].*shard i on port \+ i"),
        ({"syncer_args": ("--shards", "2")}, "syncer_args: --shards is set by the launcher itself"),
        ({"port": 0}, "a restarted syncer comes back on it"),
        ({"token": "short"}, "the launch token: "),
        ({"tls_cert": b"c"}, "tls_cert and tls_key go together"),
        ({"tls_ca": b"ca"}, "tls_ca is what learners trust"),
        ({"learner_cpus": 0}, "learner_cpus must lie in"),
        ({"learner_gpus": -1}, "learner_gpus must lie in"),
        ({"syncer_max_restarts": -2}, "syncer_max_restarts must lie in"),
        ({"checkpoint_dir": Path("ck")}, "checkpoint_dir must be an absolute path"),
        ({"syncer_args": ("--port", "1")}, "syncer_args: --port is set by the launcher itself"),
        ({"syncer_args": ("--resume=/x",)}, "syncer_args: --resume is set by the launcher itself"),
        ({"learner_args": ("--token-file", "t")}, "learner_args: --token-file is set by the launcher itself"),
    ],
)
def test_bad_settings_are_refused_saying_what_is_wrong(changes, message):
    with pytest.raises(ValueError, match=message):
        config(**changes)


def test_arguments_given_as_one_string_are_refused():
    with pytest.raises(TypeError, match="learner_args is a sequence of arguments"):
        config(learner_args="--steps 5")


def test_a_sharded_syncer_is_one_command_per_shard_each_with_its_port_and_checkpoints():
    c = config(shards=3, port=9000, syncer_args=("--fragments", "6"))
    argvs = [syncer_argv(c, Path("/p/token"), resume=i == 1, shard=i) for i in range(3)]
    for i, argv in enumerate(argvs):
        assert argv[argv.index("--port") + 1] == str(9000 + i)
        assert argv[argv.index("--shard") + 1 : argv.index("--shard") + 4] == [str(i), "--shards", "3"]
        assert argv[-2:] == ["--fragments", "6"]
    assert argvs[0][6:8] == ["--checkpoint-dir", "/ck/shard-0"] and argvs[1][6:8] == ["--resume", "/ck/shard-1"]
    assert [shard_checkpoint_dir(c, i) for i in range(3)] == [
        Path("/ck/shard-0"),
        Path("/ck/shard-1"),
        Path("/ck/shard-2"),
    ]
    assert [syncer_log_name(c, i) for i in range(3)] == ["syncer-0.log", "syncer-1.log", "syncer-2.log"]
    urls = [syncer_urls(c, "10.0.0.7", i) for i in range(3)]
    assert urls[2] == ("ws://10.0.0.7:9002/ws", "http://10.0.0.7:9002")
    with pytest.raises(ValueError, match=r"syncer shard must lie in \[0, 3\)"):
        syncer_argv(c, Path("/p/token"), resume=False, shard=3)


def test_every_learner_dials_every_shard_and_an_unsharded_syncer_is_as_before():
    c = config(shards=2)
    argv = learner_argv(c, 0, ["ws://h:1/ws", "ws://h:2/ws"], Path("/p/token"))
    assert argv[:2] == ["--syncer", "ws://h:1/ws,ws://h:2/ws"]
    with pytest.raises(ValueError, match="needs the URL of each of the 2 syncer shard"):
        learner_argv(c, 0, "ws://h:1/ws", Path("/p/token"))
    one = config()
    assert "--shard" not in syncer_argv(one, Path("/t"), resume=False)
    assert shard_checkpoint_dir(one) == Path("/ck") and syncer_log_name(one) == "syncer.log"
