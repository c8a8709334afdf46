"""What a launch runs, as values: the settings of a job and the command lines they give.

Pure: no Ray, no processes, no files. `ddiloco.launch.ray` carries a `LaunchConfig` out on a
cluster; the SLURM script and the Kubernetes manifests in `deploy/` run the same two commands.
The launcher owns the flags that wire the job together (where the syncer listens, the token and
certificate files, each learner's shard and name); everything else passes through unchanged to
`ddiloco syncer` and `ddiloco learner`, so their `--help` is the reference for it.

A syncer split into N shards (core.shards, `shards`) is N `ddiloco syncer --shard i --shards N`
processes, shard i listening on `port + i` and checkpointing to `checkpoint_dir/shard-i`; every
learner is given every shard's URL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ddiloco.core.shards import SHARDS_MAX
from ddiloco.net.auth import AuthConfigError, check_token

__all__ = [
    "LEARNER_FLAGS_OWNED",
    "SYNCER_FLAGS_OWNED",
    "LaunchConfig",
    "learner_argv",
    "shard_checkpoint_dir",
    "syncer_argv",
    "syncer_log_name",
    "syncer_urls",
]

LEARNERS_MAX = 4096
RESTARTS_MAX = 10_000
READY_S_MAX = 3600.0

# Flags the launcher sets itself; passing them through would contradict what it set.
SYNCER_FLAGS_OWNED = (
    "--host",
    "--port",
    "--auth-token-file",
    "--checkpoint-dir",
    "--resume",
    "--init",
    "--tls-cert",
    "--tls-key",
    "--insecure-no-auth",
    "--allow-shared-token",
    "--shard",
    "--shards",
)
LEARNER_FLAGS_OWNED = ("--syncer", "--token-file", "--shard", "--name", "--tls-ca")
_ANY_INTERFACE = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class LaunchConfig:
    learners: int  # M learner processes, shards 0/M ... M-1/M
    checkpoint_dir: Path  # on the syncer's node: where it writes checkpoints and resumes from after a restart
    log_dir: Path  # on each node: syncer.log, learner-<i>.log (appended across restarts)
    token: str = field(repr=False)  # the shared bearer token (net.auth); never printed, never on a command line
    host: str = "0.0.0.0"  # where the syncer listens
    port: int = 8470  # fixed, not 0: a restarted syncer must come back where the learners dial
    shards: int = 1  # syncer processes, each owning the fragments p with p mod shards == its index; on port + index
    advertise_host: str | None = None  # what learners dial (default: the syncer node's address)
    # PEM contents, not paths: the nodes need not share a filesystem (the key is written 0600 there)
    tls_cert: bytes | None = field(default=None, repr=False)
    tls_key: bytes | None = field(default=None, repr=False)
    tls_ca: bytes | None = field(default=None, repr=False)  # what learners trust (default: the system's CAs)
    syncer_args: tuple[str, ...] = ()  # passed to `ddiloco syncer` (--fragments, --quorum ...)
    learner_args: tuple[str, ...] = ()  # passed to every `ddiloco learner` (--steps, --batch, --model ...)
    syncer_cpus: float = 1.0
    learner_cpus: float = 1.0
    learner_gpus: float | None = None  # None: 1 per learner where the cluster has GPUs, else 0
    syncer_resources: Mapping[str, float] = field(default_factory=dict)  # e.g. {"syncer_node": 1}: pin it
    learner_resources: Mapping[str, float] = field(default_factory=dict)
    syncer_max_restarts: int = 10
    learner_max_restarts: int = 10
    ready_s_max: float = 600.0  # the syncer's start: warm-up, a resume, a predecessor releasing the port

    def __post_init__(self) -> None:
        if not 1 <= self.learners <= LEARNERS_MAX:
            raise ValueError(f"learners must lie in [1, {LEARNERS_MAX}], got {self.learners}")
        if not 1 <= self.shards <= SHARDS_MAX:
            raise ValueError(f"shards must lie in [1, {SHARDS_MAX}], got {self.shards}")
        if not 1 <= self.port <= 65536 - self.shards:
            raise ValueError(
                f"port must lie in [1, {65536 - self.shards}] (a restarted syncer comes back on it, "
                f"shard i on port + i), got {self.port}"
            )
        try:
            check_token(self.token)
        except AuthConfigError as exc:
            raise ValueError(f"the launch token: {exc}") from None
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ValueError("tls_ca is what learners trust for a syncer serving TLS: it needs tls_cert and tls_key")
        for what, cpus in (("syncer_cpus", self.syncer_cpus), ("learner_cpus", self.learner_cpus)):
            if not 0 < cpus <= 1024:
                raise ValueError(f"{what} must lie in (0, 1024], got {cpus}")
        if self.learner_gpus is not None and not 0 <= self.learner_gpus <= 64:
            raise ValueError(f"learner_gpus must lie in [0, 64], got {self.learner_gpus}")
        for what, n in (
            ("syncer_max_restarts", self.syncer_max_restarts),
            ("learner_max_restarts", self.learner_max_restarts),
        ):
            if not -1 <= n <= RESTARTS_MAX:
                raise ValueError(f"{what} must lie in [-1 (no limit), {RESTARTS_MAX}], got {n}")
        if not 0 < self.ready_s_max <= READY_S_MAX:
            raise ValueError(f"ready_s_max must lie in (0, {READY_S_MAX}], got {self.ready_s_max}")
        for what, path in (("checkpoint_dir", self.checkpoint_dir), ("log_dir", self.log_dir)):
            if not Path(path).is_absolute():
                raise ValueError(f"{what} must be an absolute path (the actors run elsewhere), got {str(path)!r}")
        _refuse_owned("syncer_args", self.syncer_args, SYNCER_FLAGS_OWNED)
        _refuse_owned("learner_args", self.learner_args, LEARNER_FLAGS_OWNED)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


def _refuse_owned(what: str, args: Sequence[str], owned: Sequence[str]) -> None:
    if isinstance(args, str):
        raise TypeError(f"{what} is a sequence of arguments, got the string {args!r}")
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in owned:
            raise ValueError(f"{what}: {flag} is set by the launcher itself (it owns {', '.join(owned)})")


def _check_shard(config: LaunchConfig, shard: int) -> None:
    if not 0 <= shard < config.shards:
        raise ValueError(f"syncer shard must lie in [0, {config.shards}), got {shard}")


def shard_checkpoint_dir(config: LaunchConfig, shard: int = 0) -> Path:
    """Where syncer shard `shard` checkpoints: `checkpoint_dir` itself for an unsharded syncer, else
    its own directory under it (a shard resumes only its own checkpoints)."""
    _check_shard(config, shard)
    return config.checkpoint_dir if config.shards == 1 else config.checkpoint_dir / f"shard-{shard}"


def syncer_log_name(config: LaunchConfig, shard: int = 0) -> str:
    """The log file of syncer shard `shard` in `log_dir`."""
    _check_shard(config, shard)
    return "syncer.log" if config.shards == 1 else f"syncer-{shard}.log"


def syncer_urls(config: LaunchConfig, node_address: str, shard: int = 0) -> tuple[str, str]:
    """(the learners' websocket URL, the HTTP address for /status) of syncer shard `shard` on `node_address`."""
    _check_shard(config, shard)
    host = config.advertise_host or (node_address if config.host in _ANY_INTERFACE else config.host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    secure = "s" if config.tls else ""
    port = config.port + shard
    return f"ws{secure}://{host}:{port}/ws", f"http{secure}://{host}:{port}"


def syncer_argv(
    config: LaunchConfig, token_file: Path, resume: bool, tls_files: tuple[Path, Path] | None = None, shard: int = 0
) -> list[str]:
    """The arguments of `ddiloco syncer` (shard `shard`): a restarted one resumes from its newest checkpoint."""
    args = [
        "--host",
        config.host,
        "--port",
        str(config.port + shard),
        "--auth-token-file",
        str(token_file),
        "--resume" if resume else "--checkpoint-dir",
        str(shard_checkpoint_dir(config, shard)),
    ]
    if config.shards > 1:
        args += ["--shard", str(shard), "--shards", str(config.shards)]
    if tls_files is not None:
        args += ["--tls-cert", str(tls_files[0]), "--tls-key", str(tls_files[1])]
    return args + list(config.syncer_args)


def learner_argv(
    config: LaunchConfig,
    index: int,
    syncer_url: str | Sequence[str],
    token_file: Path,
    ca_file: Path | None = None,
) -> list[str]:
    """The arguments of learner `index`'s `ddiloco learner`: its shard of the data and its name, and
    the syncer's URL (every shard's, for a sharded syncer)."""
    if not 0 <= index < config.learners:
        raise ValueError(f"learner index must lie in [0, {config.learners}), got {index}")
    urls = [syncer_url] if isinstance(syncer_url, str) else list(syncer_url)
    if len(urls) != config.shards:
        raise ValueError(f"a learner needs the URL of each of the {config.shards} syncer shard(s), got {len(urls)}")
    args = [
        "--syncer",
        ",".join(urls),
        "--token-file",
        str(token_file),
        "--shard",
        f"{index}/{config.learners}",
        "--name",
        f"learner-{index}",
    ]
    if ca_file is not None:
        args += ["--tls-ca", str(ca_file)]
    return args + list(config.learner_args)
