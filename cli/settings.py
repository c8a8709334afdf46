"""A command's settings from four places, one table: flags > `DDILOCO_*` variables > a TOML file > defaults.

Each `Setting` is declared once; from the table come the argparse flags (`--auth-token-file`), the
environment variables (`DDILOCO_AUTH_TOKEN_FILE`) and the TOML keys (`auth_token_file`): the flag's
name with its dashes turned into underscores, upper-cased and prefixed for the environment. Every
value is checked with its source named ("port in syncer.toml: ..."), unknown keys and unknown
`DDILOCO_*` variables are refused, and the result says where each value that is not the default
came from. Resolving is a pure function of the parsed flags, an environment mapping and the file's
text, so it is tested without processes.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ddiloco.errors import UserError

ENV_PREFIX = "DDILOCO_"
CONFIG_FILE_BYTES_MAX = 1 << 20
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class SettingsError(UserError, ValueError):
    """A value, key or file that cannot be used; the message names the key and where it came from."""


@dataclass(frozen=True)
class Setting:
    flag: str  # without dashes: "auth-token-file"
    kind: type  # int, float, str, bool or Path
    help: str
    default: Any = None  # None: not set (the command's own default applies, as the help says)
    choices: tuple[str, ...] = ()
    in_file: bool = True  # False for the setting that names the file itself
    bounds: tuple[float, float] | None = None  # inclusive, for numbers the command itself checks
    metavar: str | None = None

    @property
    def key(self) -> str:
        """The TOML key and the argparse dest."""
        return self.flag.replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()


@dataclass(frozen=True)
class Resolved:
    values: dict[str, Any]  # key -> value, for every setting
    sources: dict[str, str]  # key -> "flag --x", "env DDILOCO_X" or "file F", for values not from the defaults


def add_flags(parser: argparse.ArgumentParser, table: tuple[Setting, ...]) -> None:
    """One flag per setting; every default is None here so that a flag left out can be told apart."""
    for s in table:
        default = f" (default {s.default})" if s.default not in (None, False) else ""
        help_text = f"{s.help}{default}; env {s.env}"
        if s.kind is bool:
            parser.add_argument(
                f"--{s.flag}", dest=s.key, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(
                f"--{s.flag}",
                dest=s.key,
                type=_flag_parser(s),
                default=None,
                choices=s.choices or None,
                metavar=s.metavar,
                help=help_text,
            )


def resolve(
    table: tuple[Setting, ...],
    args: argparse.Namespace,
    environ: Mapping[str, str],
    config_text: str | None = None,
    config_path: Path | None = None,
) -> Resolved:
    """The settings from the flags in `args`, the `DDILOCO_*` variables in `environ` and the TOML text of
    the config file (read by the caller from `config_path`, where it names one); see the module docstring."""
    by_key = {s.key: s for s in table}
    values = {s.key: s.default for s in table}
    sources: dict[str, str] = {}
    if config_text is not None:
        name = str(config_path)
        for key, raw in _file_values(config_text, name).items():
            s = by_key.get(key)
            if s is None or not s.in_file:
                raise SettingsError(_unknown(key, f"in {name}", by_key, s is not None))
            values[key] = _check_file_value(s, raw, name, config_path)
            sources[key] = f"file {name}"
    for var, raw in sorted(environ.items()):
        if not var.startswith(ENV_PREFIX):
            continue
        key = var[len(ENV_PREFIX) :].lower()
        s = by_key.get(key)
        if s is None:
            raise SettingsError(f"unknown environment variable {var}; known: {sorted(t.env for t in table)}")
        values[key] = parse_text(s, raw, f"from env {var}")
        sources[key] = f"env {var}"
    for s in table:
        given = getattr(args, s.key, None)
        if given is not None:
            values[s.key] = given
            sources[s.key] = f"flag --{s.flag}"
    return Resolved(values, sources)


def config_location(
    table: tuple[Setting, ...], args: argparse.Namespace, environ: Mapping[str, str], config_key: str = "config"
) -> Path | None:
    """Where the config file is: its flag, else its variable (the file cannot name itself)."""
    s = next(t for t in table if t.key == config_key)
    given = getattr(args, config_key, None)
    if given is not None:
        return Path(given)
    raw = environ.get(s.env)
    return Path(raw) if raw else None


def read_config_text(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            data = fh.read(CONFIG_FILE_BYTES_MAX + 1)
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    if len(data) > CONFIG_FILE_BYTES_MAX:
        raise SettingsError(f"config file {path} is larger than {CONFIG_FILE_BYTES_MAX} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SettingsError(f"config file {path} is not UTF-8 text") from exc


def parse_text(s: Setting, raw: str, source: str) -> Any:
    """A value given as text (a flag or a variable), converted to the setting's kind and checked;
    `source` completes the error message ("from env DDILOCO_PORT")."""
    if s.kind is bool:
        word = raw.strip().lower()
        if word in _TRUE | _FALSE:
            return word in _TRUE
        raise SettingsError(f"{s.key} {source}: expected one of {sorted(_TRUE | _FALSE)}, got {raw!r}")
    try:
        value = s.kind(raw)
    except ValueError:
        raise SettingsError(f"{s.key} {source}: expected {_kind_name(s.kind)}, got {raw!r}") from None
    return _check_choice(s, value, source)


def _flag_parser(s: Setting):
    unchecked = replace(s, choices=())  # argparse checks the choices of a flag itself, and lists them

    def parse(raw: str) -> Any:
        try:
            return parse_text(unchecked, raw, f"from flag --{s.flag}")
        except SettingsError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _file_values(text: str, name: str) -> dict[str, Any]:
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {name} is not valid TOML: {exc}") from exc
    tables = sorted(k for k, v in values.items() if isinstance(v, dict))
    if tables:
        raise SettingsError(
            f"config file {name}: the keys are flat (the flags' names), no tables; found table {tables[0]!r}"
        )
    return values


def _check_file_value(s: Setting, raw: Any, name: str, path: Path | None) -> Any:
    source = f"in {name}"
    if s.kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        raw = float(raw)
    expected = str if s.kind is Path else s.kind
    if isinstance(raw, bool) != (expected is bool) or not isinstance(raw, expected):
        raise SettingsError(f"{s.key} {source}: expected {_kind_name(s.kind)}, got {type(raw).__name__} {raw!r}")
    if s.kind is Path:
        # A path in the file is relative to the file, so that a config kept beside its token and
        # checkpoint directory works from any working directory.
        value = Path(raw).expanduser()
        return value if value.is_absolute() or path is None else path.parent / value
    return _check_choice(s, raw, source)


def _check_choice(s: Setting, value: Any, source: str) -> Any:
    if s.choices and value not in s.choices:
        raise SettingsError(f"{s.key} {source}: {value!r} is not one of {list(s.choices)}")
    if s.bounds is not None and not s.bounds[0] <= value <= s.bounds[1]:  # NaN fails both
        raise SettingsError(f"{s.key} {source}: {value!r} is outside [{s.bounds[0]}, {s.bounds[1]}]")
    return value


def _unknown(key: str, where: str, by_key: Mapping[str, Setting], exists: bool) -> str:
    if exists:
        return f"{key} {where}: not allowed in a config file"
    hint = key.replace("-", "_")
    if hint in by_key:
        return f"unknown key {key!r} {where}: keys are the flags' names with underscores, did you mean {hint!r}?"
    return f"unknown key {key!r} {where}; known: {sorted(k for k, s in by_key.items() if s.in_file)}"


def _kind_name(kind: type) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "text", Path: "a path"}[kind]
