"""`ddiloco export`: the syncer's global parameters out of a checkpoint, as safetensors, npz or orbax.

The newest valid checkpoint of a directory (or the checkpoint file given), every tensor under its
pytree path in its shape; `ddiloco.learner.params_file.load_params(path, like=params)` loads the
result into a model's pytree (docs/getting-started.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

FORMATS = ("safetensors", "npz", "orbax")  # learner.params_file.FORMATS, without importing it for --help


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        type=Path,
        metavar="CHECKPOINT",
        help="a checkpoint directory (its newest valid checkpoint is read) or one checkpoint file",
    )
    p.add_argument("--format", required=True, choices=FORMATS, help="safetensors or npz: one file; orbax: a directory")
    p.add_argument("--out", required=True, type=Path, help="where to write (must not exist yet)")


def run(args: argparse.Namespace) -> int:
    from ddiloco.learner import params_file

    done = params_file.export(args.checkpoint, args.out, args.format)
    print(
        f"wrote {done.tensors} tensors ({done.values:,} values) of {done.checkpoint} "
        f"(merge {done.merges}, global step {done.global_step}) to {done.path} as {args.format}"
    )
    return 0
