"""Which accelerators a learner process uses, decided before JAX starts its backend.

JAX picks its devices once, when its backend initialises (the first `jax.devices()` or the first
computation), and from then on a process cannot change them. CUDA reads `CUDA_VISIBLE_DEVICES` at
that moment, and JAX's GPU client reads `XLA_PYTHON_CLIENT_PREALLOCATE` and
`XLA_PYTHON_CLIENT_MEM_FRACTION` when it creates its allocator. So a learner chooses its devices by
setting those variables in its own process before anything touches the backend
(`ddiloco learner --devices SPEC [--memory-fraction F]` does it first thing).

    SPEC    what the learner process sees
    all     every device JAX finds (nothing is set)
    cpu     the host CPU only (JAX_PLATFORMS=cpu, no GPU is opened)
    0       GPU 0; `0,1` GPUs 0 and 1. Indices count the GPUs this process may see: where
            CUDA_VISIBLE_DEVICES is set already (a scheduler's allocation), `1` is its second entry

By default JAX preallocates 75% of a GPU's memory in the first process that opens it, so a second
process on the same GPU fails to allocate. Learners that share a GPU each get a cap instead
(`memory_fraction`: no preallocation, and at most that share of the GPU's memory).

`learner_device_plan(gpus, learners)` is the rule the demo follows, a pure function: with at least
as many GPUs as learners each learner gets its own GPU; with fewer, learners take the GPUs round robin
and those that share one split MEMORY_SHARE_USABLE of its memory evenly; on a host without GPUs
nothing changes. `visible_gpu_count` is how the demo counts GPUs without starting JAX in its own
process (which would hold on to a GPU for the whole run): `nvidia-smi -L`, and only where that tool
is missing but JAX's CUDA plugin is installed, a short spawned probe.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

from ddiloco.errors import UserError

__all__ = [
    "DEVICES_PER_SPEC_MAX",
    "DEVICE_INDEX_MAX",
    "MEMORY_SHARE_USABLE",
    "PROBE_S_MAX",
    "DeviceSpec",
    "DeviceSpecError",
    "LearnerDevices",
    "apply_devices",
    "check_devices",
    "device_env",
    "learner_device_plan",
    "parse_devices",
    "visible_gpu_count",
]

DEVICE_INDEX_MAX = 1023  # larger than any host's GPU count; a bigger index is a typo
DEVICES_PER_SPEC_MAX = 64
# Of a GPU's memory, the share that learners sharing it split between them. The rest is left for
# what lives outside XLA's allocator: each process's CUDA context (a few hundred MiB) and cuDNN/cuBLAS
# workspaces, which a per-process fraction does not count.
MEMORY_SHARE_USABLE = 0.85
PROBE_S_MAX = 120.0  # the spawned JAX probe (imports and backend start) gives up after this
_CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


class DeviceSpecError(UserError, ValueError):
    """A `--devices` or `--memory-fraction` value that names no usable set of devices."""


@dataclass(frozen=True)
class DeviceSpec:
    """`kind` is "all", "cpu" or "gpus"; `gpus` the indices for "gpus", in the order given."""

    kind: str
    gpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert self.kind in ("all", "cpu", "gpus"), self.kind
        assert (self.kind == "gpus") == bool(self.gpus), self

    def __str__(self) -> str:
        return ",".join(map(str, self.gpus)) if self.kind == "gpus" else self.kind


def parse_devices(text: str) -> DeviceSpec:
    """`all`, `cpu`, or comma-separated GPU indices (`0`, `0,1`); anything else is a DeviceSpecError."""
    cleaned = text.strip().lower()
    if cleaned in ("all", "cpu"):
        return DeviceSpec(cleaned)
    parts = [p.strip() for p in cleaned.split(",")]
    if not cleaned or not all(p.isdigit() for p in parts):
        raise DeviceSpecError(f"--devices {text!r}: expected all, cpu, or GPU indices such as 0 or 0,1")
    indices = tuple(int(p) for p in parts)
    if len(set(indices)) != len(indices):
        raise DeviceSpecError(f"--devices {text!r}: a GPU is named twice")
    if len(indices) > DEVICES_PER_SPEC_MAX or max(indices) > DEVICE_INDEX_MAX:
        raise DeviceSpecError(
            f"--devices {text!r}: at most {DEVICES_PER_SPEC_MAX} GPUs, each an index up to {DEVICE_INDEX_MAX}"
        )
    return DeviceSpec("gpus", indices)


def device_env(spec: DeviceSpec, memory_fraction: float | None, inherited_visible: str | None) -> dict[str, str]:
    """The environment variables that make a process see `spec`'s devices. `inherited_visible` is the
    CUDA_VISIBLE_DEVICES the process started with (None: unset): indices count its entries."""
    if memory_fraction is not None and not 0 < memory_fraction <= 1:
        raise DeviceSpecError(f"--memory-fraction must lie in (0, 1], got {memory_fraction}")
    if spec.kind == "cpu":
        if memory_fraction is not None:
            raise DeviceSpecError("--memory-fraction caps GPU memory: it does not go with --devices cpu")
        # Both: JAX then does not look for a GPU at all, and CUDA would not show it one anyway.
        return {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    env: dict[str, str] = {}
    if spec.kind == "gpus":
        if inherited_visible is None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, spec.gpus))
        else:
            allowed = [e.strip() for e in inherited_visible.split(",") if e.strip()]
            outside = [i for i in spec.gpus if i >= len(allowed)]
            if outside:
                raise DeviceSpecError(
                    f"--devices {spec}: this process may see {len(allowed)} GPU(s) "
                    f"(CUDA_VISIBLE_DEVICES={inherited_visible!r}), so index {outside[0]} is not one of them"
                )
            env["CUDA_VISIBLE_DEVICES"] = ",".join(allowed[i] for i in spec.gpus)
    if memory_fraction is not None:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # grow on demand, up to the cap below
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{memory_fraction:.3f}"
    return env


def apply_devices(
    spec: DeviceSpec, memory_fraction: float | None = None, environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Set this process's environment for `spec` (and the memory cap); returns what was set. Must run
    before JAX's backend starts: after that the devices are fixed, and calling this is a bug."""
    environ = os.environ if environ is None else environ
    env = device_env(spec, memory_fraction, environ.get("CUDA_VISIBLE_DEVICES"))
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        assert not xla_bridge.backends_are_initialized(), "devices chosen after JAX's backend started"
        if spec.kind == "cpu":
            # JAX read JAX_PLATFORMS when it was imported; its config is what it consults at start.
            sys.modules["jax"].config.update("jax_platforms", "cpu")
    environ.update(env)
    return env


def check_devices(spec: DeviceSpec) -> str:
    """Start JAX's backend and check it holds what `spec` asked for; returns the devices in words.
    A GPU asked for and not found (no CUDA-enabled jax, a wrong index) is a DeviceSpecError."""
    import jax

    devices = jax.devices()
    words = ", ".join(f"{d.platform}:{d.id}" for d in devices)
    if spec.kind == "gpus" and (len(devices) != len(spec.gpus) or any(d.platform != "gpu" for d in devices)):
        raise DeviceSpecError(
            f"--devices {spec}: asked for {len(spec.gpus)} GPU(s), JAX sees {words} "
            "(is a CUDA-enabled jax installed, and does the index exist on this host?)"
        )
    assert spec.kind != "cpu" or all(d.platform == "cpu" for d in devices), words
    return words


@dataclass(frozen=True)
class LearnerDevices:
    """One learner's share of the host: its `--devices` SPEC (None: leave JAX's choice) and memory cap."""

    devices: DeviceSpec | None = None
    memory_fraction: float | None = None

    def argv(self) -> list[str]:
        """The `ddiloco learner` flags that give a learner process this share."""
        flags = [] if self.devices is None else ["--devices", str(self.devices)]
        if self.memory_fraction is not None:
            flags += ["--memory-fraction", f"{self.memory_fraction:.3f}"]
        return flags


def learner_device_plan(gpus: int, learners: int) -> list[LearnerDevices]:
    """Learner i's devices when `learners` learners share a host with `gpus` GPUs (see the module)."""
    assert gpus >= 0 and learners >= 1, (gpus, learners)
    if gpus == 0:
        return [LearnerDevices() for _ in range(learners)]
    sharing = [sum(1 for j in range(learners) if j % gpus == g) for g in range(gpus)]
    plan = []
    for i in range(learners):
        g = i % gpus
        fraction = None
        if sharing[g] > 1:  # rounded down, so that the caps never add up to more than the usable share
            fraction = math.floor(1000 * MEMORY_SHARE_USABLE / sharing[g]) / 1000
            assert fraction > 0, (gpus, learners)
        plan.append(LearnerDevices(DeviceSpec("gpus", (g,)), fraction))
    return plan


def visible_gpu_count(
    environ: Mapping[str, str] | None = None,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
    cuda_plugin_installed: Callable[[], bool] | None = None,
) -> int:
    """GPUs a process started from this one may use, found without starting JAX here. In order: a
    JAX_PLATFORMS without a GPU platform means none; a set CUDA_VISIBLE_DEVICES counts its entries;
    else `nvidia-smi -L` counts them; without nvidia-smi, a spawned `jax.device_count('gpu')` where
    JAX's CUDA plugin is installed; else none. `run` and `cuda_plugin_installed` are for tests."""
    environ = os.environ if environ is None else environ
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return 0
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        # CUDA stops at the first invalid entry; "-1" is the usual way to hide every GPU
        return 0 if not entries or entries[0].startswith("-") else len(entries)
    try:
        listed = run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=PROBE_S_MAX, check=False)
    except FileNotFoundError:
        listed = None
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if listed is not None:
        lines = listed.stdout.splitlines() if listed.returncode == 0 else []
        return sum(1 for line in lines if line.startswith("GPU "))
    installed = cuda_plugin_installed or (lambda: any(importlib.util.find_spec(p) for p in _CUDA_PLUGINS))
    if not installed():
        return 0
    probe = "import jax; print(jax.device_count('gpu') if jax.default_backend() == 'gpu' else 0)"
    try:
        done = run(
            [sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            timeout=PROBE_S_MAX,
            check=False,
            env={**environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"},  # a probe holds no GPU memory
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    last = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else []
    return int(last[0]) if last and last[0].isdigit() else 0
