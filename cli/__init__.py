"""The one console script, `ddiloco`, and its subcommands.

Each subcommand is a module of this package exposing `add_arguments(parser)` and `run(args) -> int`.
Modules are imported only when their subcommand runs (or `--help` lists them), and they import their
heavy dependencies (numba kernels, jax) inside `run`, so `ddiloco syncer` works on the base install and
a jax subcommand without the `learner` extra fails with a message that says how to fix it.

Errors reach the user once, here: a `UserError` (bad input, a refusal) as one line and exit status 2,
a `FaultError` (network, disk, a peer that died) as one line and what to do, exit status 1. Anything
else is a bug and keeps its traceback, a plain `ValueError` included.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator, Sequence

from ddiloco.errors import DdilocoError, UserError, one_line

# name -> (module, one-line help). Order is the order `--help` lists them.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "syncer": ("ddiloco.cli.syncer", "run the syncer daemon"),
    "status": (
        "ddiloco.cli.status",
        "a running syncer at a glance: learners, fragments, decisions, tokens (--json: raw)",
    ),
    "export": ("ddiloco.cli.export", "write the trained model out of a syncer checkpoint (safetensors, npz or orbax)"),
    "snapshot": ("ddiloco.cli.snapshot", "take a consistent snapshot of a running syncer and its learners"),
    "demo": ("ddiloco.cli.demo", "the chaos demo: a syncer and learners surviving kills (needs the learner extra)"),
    "learner": ("ddiloco.cli.learner", "run one learner of the reference model (needs the learner extra)"),
    "launch": (
        "ddiloco.cli.launch",
        "start a syncer and learners on a cluster engine: `launch ray` (needs the launch extra)",
    ),
    "bench": ("ddiloco.cli.bench", "run a benchmark and print its table"),
    "replay": ("ddiloco.cli.replay", "replay a syncer's event tape and check it reproduces the run bit for bit"),
    "simulate": ("ddiloco.cli.simulate", "goodput simulator for large clusters under chip failures"),
    "chaos-sim": ("ddiloco.cli.chaos_sim", "deterministic simulation test of the syncer under faults drawn from seeds"),
    "experiment": (
        "ddiloco.cli.experiment",
        "the paper's experiments in one process on a virtual clock (needs the learner extra)",
    ),
    "fuzz": ("ddiloco.cli.fuzz", "fuzz a real syncer daemon with mutated frames while honest learners train"),
}


class MissingExtraError(UserError, RuntimeError):
    """A subcommand needs an optional dependency that is not installed."""


def require_learner_extra() -> None:
    """Raise a clear error when jax/optax (the `learner` extra) are missing."""
    missing = [m for m in ("jax", "optax") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(
            f"this subcommand needs {', '.join(missing)}: install the learner extra, "
            "for example `pip install 'ddiloco[learner]'`"
        )


@contextlib.contextmanager
def user_input() -> Iterator[None]:
    """Around building a configuration from the command line: its dataclasses check their values and
    raise ValueError, and a bad value given on the command line is the user's to fix, not a bug."""
    try:
        yield
    except DdilocoError:
        raise
    except ValueError as exc:
        raise UserError(str(exc)) from exc


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or with `command` of that one only (the others listed by name):
    a subcommand's module imports what its flags need (the status command: urllib and ssl), and a
    restarted syncer should not pay for the other commands' imports before it listens."""
    parser = argparse.ArgumentParser(prog="ddiloco", description="Decoupled DiLoCo syncer, learners and tools")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if command is None or name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    args = build_parser(command).parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except DdilocoError as exc:
        status, line = one_line(f"ddiloco {args.command}", exc)
        print(line, file=sys.stderr)
        return status
    except BrokenPipeError:
        # Whoever read our output stopped (`ddiloco status | head`): nothing of ours failed. Point stdout
        # at /dev/null so the interpreter's last flush at exit does not raise the same error again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
