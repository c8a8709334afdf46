"""`ddiloco launch ray`: run a job's syncer and learners on a Ray cluster (ddiloco.launch.ray).

Prints one JSON line once the syncer listens and the learners are started (where the syncer is, where
the logs go), waits until every learner has spent its step budget, then stops the job cleanly: the
learners say goodbye, the syncer writes a last checkpoint. Ctrl-C or SIGTERM stop it the same way.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import signal
import sys
from pathlib import Path

RESOURCES_MAX = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="engine", metavar="ENGINE", required=True)
    r = sub.add_parser(
        "ray",
        help="the syncer and learners as Ray actors with restart policies",
        description="Start the syncer and M learners as Ray actors (needs the launch extra).",
    )
    r.add_argument("--learners", type=int, required=True, metavar="M", help="number of learners (shards 0/M ... M-1/M)")
    r.add_argument("--address", help="the Ray cluster to join (default: RAY_ADDRESS, else a new local one)")
    r.add_argument(
        "--token-file",
        type=Path,
        required=True,
        help="the shared bearer token (mode 0600); reaches the actors as a 0600 file",
    )
    r.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path("ddiloco-checkpoints"),
        help="the syncer's checkpoints, on its node; a restarted syncer resumes from here (default ./ddiloco-checkpoints)",
    )
    r.add_argument(
        "--log-dir",
        type=Path,
        default=Path("ddiloco-logs"),
        help="syncer.log (syncer-<i>.log per shard) and learner-<i>.log, on each node (default ./ddiloco-logs)",
    )
    r.add_argument("--host", default="0.0.0.0", help="where the syncer listens (default every interface)")
    r.add_argument("--port", type=int, default=8470, help="the syncer's port, kept across its restarts (default 8470)")
    r.add_argument(
        "--shards",
        type=int,
        default=1,
        metavar="N",
        help="split the syncer into N shards by fragment (default 1): shard i listens on --port + i and "
        "checkpoints to --checkpoint-dir/shard-i; every learner dials them all",
    )
    r.add_argument("--advertise-host", help="what learners dial (default: the syncer node's address)")
    r.add_argument(
        "--tls-cert", type=Path, metavar="FILE", help="serve wss:// with this PEM certificate (needs --tls-key)"
    )
    r.add_argument("--tls-key", type=Path, metavar="FILE", help="the PEM private key of --tls-cert")
    r.add_argument(
        "--tls-ca",
        type=Path,
        metavar="FILE",
        help="what learners trust for the syncer's certificate (default: the system's CAs)",
    )
    r.add_argument("--syncer-cpus", type=float, default=1.0, help="CPUs Ray reserves for the syncer (default 1)")
    r.add_argument("--learner-cpus", type=float, default=1.0, help="CPUs Ray reserves per learner (default 1)")
    r.add_argument(
        "--learner-gpus", type=float, help="GPUs per learner (default: 1 where the cluster has GPUs, else 0)"
    )
    r.add_argument(
        "--syncer-resources",
        default="",
        metavar="K=V,...",
        help="custom Ray resources the syncer needs, to pin it to a node (e.g. syncer_node=1)",
    )
    r.add_argument("--learner-resources", default="", metavar="K=V,...", help="custom Ray resources each learner needs")
    r.add_argument(
        "--syncer-max-restarts", type=int, default=10, help="times Ray restarts the syncer (-1: no limit; default 10)"
    )
    r.add_argument(
        "--learner-max-restarts",
        type=int,
        default=10,
        help="times Ray restarts each learner (-1: no limit; default 10)",
    )
    r.add_argument(
        "--syncer-args",
        default="",
        metavar="'ARGS'",
        help="more `ddiloco syncer` arguments as one word, after '=' (e.g. --syncer-args='--fragments 8 --quorum 2')",
    )
    r.add_argument(
        "--learner-args",
        default="",
        metavar="'ARGS'",
        help="more `ddiloco learner` arguments as one word, after '=' (e.g. --learner-args='--steps 2000')",
    )


def _resources(text: str, what: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            amount = float(value)
        except ValueError:
            amount = -1.0
        if not sep or not name or amount < 0:
            raise ValueError(f"{what}: expected NAME=AMOUNT[,NAME=AMOUNT...], got {item!r}")
        out[name] = amount
    if len(out) > RESOURCES_MAX:
        raise ValueError(f"{what}: at most {RESOURCES_MAX} resources")
    return out


def _read(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def config_from_args(args: argparse.Namespace):
    """The LaunchConfig the flags describe (files read here, on the machine that launches)."""
    from ddiloco.launch.plan import LaunchConfig
    from ddiloco.net.auth import read_token_file

    return LaunchConfig(
        learners=args.learners,
        checkpoint_dir=args.checkpoint_dir.resolve(),
        log_dir=args.log_dir.resolve(),
        token=read_token_file(args.token_file),
        host=args.host,
        port=args.port,
        shards=args.shards,
        advertise_host=args.advertise_host,
        tls_cert=_read(args.tls_cert, "the TLS certificate"),
        tls_key=_read(args.tls_key, "the TLS key"),
        tls_ca=_read(args.tls_ca, "the TLS CA file"),
        syncer_args=tuple(shlex.split(args.syncer_args)),
        learner_args=tuple(shlex.split(args.learner_args)),
        syncer_cpus=args.syncer_cpus,
        learner_cpus=args.learner_cpus,
        learner_gpus=args.learner_gpus,
        syncer_resources=_resources(args.syncer_resources, "--syncer-resources"),
        learner_resources=_resources(args.learner_resources, "--learner-resources"),
        syncer_max_restarts=args.syncer_max_restarts,
        learner_max_restarts=args.learner_max_restarts,
    )


def run(args: argparse.Namespace) -> int:
    from ddiloco.cli import MissingExtraError

    if importlib.util.find_spec("ray") is None:
        raise MissingExtraError(
            "this subcommand needs ray: install the launch extra, for example `pip install 'ddiloco[launch]'`"
        )
    config = config_from_args(args)  # bad flags are refused before a cluster starts
    import ray

    from ddiloco.launch.process import LaunchError
    from ddiloco.launch.ray import launch

    ray.init(address=args.address, log_to_driver=False)
    # SIGTERM (a scheduler ending the job) stops it like Ctrl-C: cleanly.
    signal.signal(signal.SIGTERM, lambda *_: signal.default_int_handler(signal.SIGINT, None))
    try:
        job = launch(config)
    except LaunchError as exc:
        print(f"ddiloco launch: {exc}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                "syncer": ",".join(job.syncer_urls),  # what `ddiloco learner --syncer` takes
                "status": job.status_url if len(job.status_urls) == 1 else job.status_urls,
                "learners": config.learners,
                "logs": str(config.log_dir),
                "checkpoints": str(config.checkpoint_dir),
            }
        ),
        flush=True,
    )
    code = 0
    try:
        codes = job.wait()
        code = 0 if all(c == 0 for c in codes) else 1
    except KeyboardInterrupt:
        print("ddiloco launch: stopping the job", file=sys.stderr)
    except LaunchError as exc:
        print(f"ddiloco launch: {exc}", file=sys.stderr)
        code = 1
    finally:
        status = None
        try:
            status = job.status()
        except Exception as exc:  # noqa: BLE001 - the summary is a courtesy; the stop below is what matters
            print(f"ddiloco launch: no final status: {exc}", file=sys.stderr)
        job.shutdown()
    if status is not None:
        print(json.dumps({"merges": status["merges"], "global_step": status["global_step"]}), flush=True)
    return code
