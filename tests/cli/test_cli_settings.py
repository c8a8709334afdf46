"""Settings from flags, `DDILOCO_*` variables and a TOML file, resolved without a process."""

import argparse
import dataclasses
from pathlib import Path

import pytest

from ddiloco.cli import syncer
from ddiloco.cli.settings import Setting, SettingsError, add_flags, resolve
from ddiloco.core.config import SyncerConfig, from_mapping

TABLE = (
    Setting("config", Path, "the file", in_file=False),
    Setting("port", int, "port", default=8470, bounds=(0, 65535)),
    Setting("rate", float, "a rate"),
    Setting("mode", str, "a mode", choices=("a", "b")),
    Setting("token-file", Path, "a path"),
    Setting("loud", bool, "a switch", default=False),
)


def _parse(*argv):
    parser = argparse.ArgumentParser()
    add_flags(parser, TABLE)
    return parser.parse_args(list(argv))


def test_flags_beat_variables_beat_the_file_beat_the_defaults(tmp_path):
    text = 'port = 1\nrate = 2\nmode = "a"\ntoken_file = "tok"\n'
    env = {"DDILOCO_PORT": "3", "DDILOCO_RATE": "4.5", "OTHER": "ignored"}
    got = resolve(TABLE, _parse("--port", "5"), env, text, tmp_path / "conf.toml")
    assert got.values == {
        "config": None,
        "port": 5,
        "rate": 4.5,
        "mode": "a",
        "token_file": tmp_path / "tok",
        "loud": False,
    }
    assert got.sources == {
        "port": "flag --port",
        "rate": "env DDILOCO_RATE",
        "mode": f"file {tmp_path / 'conf.toml'}",
        "token_file": f"file {tmp_path / 'conf.toml'}",
    }
    assert resolve(TABLE, _parse(), {}).values["port"] == 8470
    assert resolve(TABLE, _parse(), {}).sources == {}


def test_switches_from_each_place_and_a_flag_turns_one_off(tmp_path):
    assert resolve(TABLE, _parse(), {"DDILOCO_LOUD": "yes"}).values["loud"] is True
    assert resolve(TABLE, _parse("--no-loud"), {"DDILOCO_LOUD": "1"}).values["loud"] is False
    assert resolve(TABLE, _parse(), {}, "loud = true\n", tmp_path / "c.toml").values["loud"] is True
    with pytest.raises(SettingsError, match="loud in .*c.toml: expected true or false, got str 'yes'"):
        resolve(TABLE, _parse(), {}, 'loud = "yes"\n', tmp_path / "c.toml")


def test_an_integer_in_the_file_is_a_number_but_not_the_other_way_round(tmp_path):
    assert resolve(TABLE, _parse(), {}, "rate = 2\n", tmp_path / "c.toml").values["rate"] == 2.0
    with pytest.raises(SettingsError, match="port in .*: expected an integer, got float 2.5"):
        resolve(TABLE, _parse(), {}, "port = 2.5\n", tmp_path / "c.toml")
    with pytest.raises(SettingsError, match="port in .*: expected an integer, got bool True"):
        resolve(TABLE, _parse(), {}, "port = true\n", tmp_path / "c.toml")


@pytest.mark.parametrize("raw", ["nan", "-1", "65536"])
def test_a_number_out_of_its_bounds_is_refused_naming_its_source(raw):
    with pytest.raises(SettingsError, match=f"port from env DDILOCO_PORT: {raw if raw != 'nan' else 'expected'}"):
        resolve(TABLE, _parse(), {"DDILOCO_PORT": raw})


def test_a_bad_flag_is_refused_by_argparse_with_the_same_message(capsys):
    with pytest.raises(SystemExit):
        _parse("--port", "70000")
    assert "port from flag --port: 70000 is outside [0, 65535]" in capsys.readouterr().err


def test_absolute_and_home_paths_in_the_file_are_kept(tmp_path):
    elsewhere = tmp_path.parent / "elsewhere" / "tok"
    got = resolve(TABLE, _parse(), {}, f'token_file = "{elsewhere}"\n', tmp_path / "c.toml")
    assert got.values["token_file"] == elsewhere
    got = resolve(TABLE, _parse(), {}, 'token_file = "~/tok"\n', tmp_path / "c.toml")
    assert got.values["token_file"] == Path.home() / "tok"


def test_every_syncer_setting_is_a_flag_a_variable_and_a_key_named_by_one_rule():
    keys = [s.key for s in syncer.SETTINGS]
    assert len(set(keys)) == len(keys)
    for s in syncer.SETTINGS:
        assert s.key == s.flag.replace("-", "_") and s.env == "DDILOCO_" + s.key.upper()
    parser = argparse.ArgumentParser()
    syncer.add_arguments(parser)
    flags = {a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"}
    assert flags == {f"--{s.flag}" for s in syncer.SETTINGS}
    assert {"host", "port", "auth_token_file", "checkpoint_dir", "config"} <= set(keys)


def test_every_core_setting_reaches_the_core_config_field_its_help_names():
    defaults = SyncerConfig().to_dict()
    for key, target in syncer.CORE_KEYS.items():
        assert key in {s.key for s in syncer.SETTINGS}
        table, _, name = target.rpartition(".")
        default = defaults[table][name] if table else defaults[name]
        help_text = next(s.help for s in syncer.SETTINGS if s.key == key)
        if "(default" in help_text:  # the help states the core's default: it must be the core's
            assert (
                f"(default {default:g}" in help_text
                if not isinstance(default, str)
                else f"(default {default})" in help_text
            )
        changed = from_mapping(syncer._nested({key: default}))
        assert changed == SyncerConfig()


def test_a_core_value_the_core_refuses_names_the_setting_and_its_source():
    resolved = resolve(syncer.SETTINGS, argparse.Namespace(), {"DDILOCO_QUORUM": "3", "DDILOCO_LEARNERS_MAX": "2"})
    with pytest.raises(
        SettingsError, match=r"quorum must be .*\(quorum from env DDILOCO_QUORUM, learners_max from env"
    ):
        syncer.core_config(resolved)
    resolved = resolve(syncer.SETTINGS, argparse.Namespace(), {"DDILOCO_GRACE_GAMMA": "1.5"})
    with pytest.raises(SettingsError, match=r"\(grace_gamma from env DDILOCO_GRACE_GAMMA\)"):
        syncer.core_config(resolved)
    assert dataclasses.asdict(
        syncer.core_config(resolve(syncer.SETTINGS, argparse.Namespace(), {}))
    ) == dataclasses.asdict(SyncerConfig())
