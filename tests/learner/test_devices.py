"""learner.devices: the --devices grammar, the environment it sets, the demo's plan and the GPU count."""

import subprocess
import sys

import pytest

from ddiloco.learner.devices import (
    DEVICE_INDEX_MAX,
    MEMORY_SHARE_USABLE,
    DeviceSpec,
    DeviceSpecError,
    LearnerDevices,
    device_env,
    learner_device_plan,
    parse_devices,
    visible_gpu_count,
)


@pytest.mark.parametrize(
    "text, spec",
    [
        ("all", DeviceSpec("all")),
        (" CPU ", DeviceSpec("cpu")),
        ("0", DeviceSpec("gpus", (0,))),
        ("3,1", DeviceSpec("gpus", (3, 1))),
        ("0, 1", DeviceSpec("gpus", (0, 1))),
    ],
)
def test_specs_parse_and_print_back(text, spec):
    assert parse_devices(text) == spec
    assert parse_devices(str(spec)) == spec


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "expected all, cpu, or GPU indices"),
        ("gpu0", "expected all, cpu, or GPU indices"),
        ("-1", "expected all, cpu, or GPU indices"),
        ("0,,1", "expected all, cpu, or GPU indices"),
        ("1.5", "expected all, cpu, or GPU indices"),
        ("0,0", "named twice"),
        (str(DEVICE_INDEX_MAX + 1), f"index up to {DEVICE_INDEX_MAX}"),
    ],
)
def test_bad_specs_are_user_errors_that_say_what_is_expected(text, message):
    with pytest.raises(DeviceSpecError, match=message):
        parse_devices(text)


def test_the_environment_of_each_kind_of_spec():
    assert device_env(DeviceSpec("all"), None, None) == {}
    assert device_env(DeviceSpec("cpu"), None, "0,1") == {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    assert device_env(parse_devices("0,1"), None, None) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    # indices count the GPUs the process was given (a scheduler's allocation), not the host's
    assert device_env(parse_devices("1"), None, "4,5") == {"CUDA_VISIBLE_DEVICES": "5"}
    assert device_env(parse_devices("0"), 0.4251, None) == {
        "CUDA_VISIBLE_DEVICES": "0",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.425",
    }
    assert device_env(DeviceSpec("all"), 0.5, None) == {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.500",
    }


@pytest.mark.parametrize(
    "spec, fraction, visible, message",
    [
        ("2", None, "4,5", "may see 2 GPU"),
        ("0", None, "", "may see 0 GPU"),
        ("0", 0.0, None, r"must lie in \(0, 1\]"),
        ("0", 1.5, None, r"must lie in \(0, 1\]"),
        ("cpu", 0.5, None, "does not go with --devices cpu"),
    ],
)
def test_environments_that_cannot_work_are_refused(spec, fraction, visible, message):
    with pytest.raises(DeviceSpecError, match=message):
        device_env(parse_devices(spec), fraction, visible)


def test_plan_on_a_host_without_gpus_changes_nothing():
    assert learner_device_plan(0, 4) == [LearnerDevices()] * 4
    assert all(d.argv() == [] for d in learner_device_plan(0, 4))


def test_plan_gives_each_learner_its_own_gpu_where_there_are_enough():
    plan = learner_device_plan(8, 4)
    assert [d.argv() for d in plan] == [["--devices", str(i)] for i in range(4)]
    assert all(d.memory_fraction is None for d in plan)  # alone on its GPU: JAX's defaults are right


def test_plan_on_one_gpu_caps_every_learner_at_an_even_share_with_margin():
    plan = learner_device_plan(1, 4)
    assert all(d.devices == DeviceSpec("gpus", (0,)) for d in plan)
    assert {d.memory_fraction for d in plan} == {0.212}  # 0.85 / 4, rounded down
    assert plan[0].argv() == ["--devices", "0", "--memory-fraction", "0.212"]


@pytest.mark.parametrize("gpus, learners", [(1, 1), (1, 2), (1, 3), (2, 3), (3, 8), (4, 4), (2, 5), (1, 64)])
def test_plan_never_overcommits_a_gpu_and_uses_every_gpu_it_can(gpus, learners):
    plan = learner_device_plan(gpus, learners)
    per_gpu: dict[int, list] = {}
    for d in plan:
        (g,) = d.devices.gpus
        per_gpu.setdefault(g, []).append(d.memory_fraction)
    assert sorted(per_gpu) == list(range(min(gpus, learners)))
    for fractions in per_gpu.values():
        if len(fractions) == 1:
            assert fractions == [None]
        else:  # nobody on a shared GPU keeps JAX's 75% preallocation
            assert None not in fractions and sum(fractions) <= MEMORY_SHARE_USABLE + 1e-9
            assert max(fractions) - min(fractions) == 0
    assert max(len(f) for f in per_gpu.values()) - min(len(f) for f in per_gpu.values()) <= 1


class FakeRun:
    """subprocess.run's stand-in: what nvidia-smi (or the probe) says, or that it is missing."""

    def __init__(self, stdout=None, returncode=0):
        self.stdout, self.returncode, self.calls = stdout, returncode, []

    def __call__(self, argv, **kwargs):
        self.calls.append(argv)
        if self.stdout is None:
            raise FileNotFoundError(argv[0])
        return subprocess.CompletedProcess(argv, self.returncode, self.stdout, "")


SMI_TWO = "GPU 0: NVIDIA H200 (UUID: GPU-aaaa)\nGPU 1: NVIDIA H200 (UUID: GPU-bbbb)\n"


def test_gpu_count_from_nvidia_smi():
    run = FakeRun(SMI_TWO)
    assert visible_gpu_count({}, run) == 2 and run.calls == [["nvidia-smi", "-L"]]
    assert visible_gpu_count({}, FakeRun("No devices were found\n", returncode=6)) == 0


def test_gpu_count_follows_the_environment_before_asking_nvidia_smi():
    run = FakeRun(SMI_TWO)
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "3"}, run) == 1
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}, run) == 0
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "-1"}, run) == 0
    assert visible_gpu_count({"JAX_PLATFORMS": "cpu"}, run) == 0
    assert run.calls == []
    assert visible_gpu_count({"JAX_PLATFORMS": "cuda,cpu"}, run) == 2


def test_without_nvidia_smi_the_probe_runs_only_where_jax_can_use_cuda():
    missing = FakeRun(None)
    assert visible_gpu_count({}, missing, cuda_plugin_installed=lambda: False) == 0
    assert missing.calls == [["nvidia-smi", "-L"]]

    class ProbeSays(FakeRun):
        def __call__(self, argv, **kwargs):
            self.calls.append(argv)
            if argv[0] == "nvidia-smi":
                raise FileNotFoundError(argv[0])
            assert kwargs["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
            return subprocess.CompletedProcess(argv, 0, "3\n", "")

    probe = ProbeSays()
    assert visible_gpu_count({}, probe, cuda_plugin_installed=lambda: True) == 3
    assert probe.calls[1][0] == sys.executable


_CHILD = """
import os, sys
from ddiloco.learner.devices import apply_devices, check_devices, parse_devices
spec = parse_devices(sys.argv[1])
apply_devices(spec)
print(os.environ["JAX_PLATFORMS"], repr(os.environ["CUDA_VISIBLE_DEVICES"]), check_devices(spec))
try:
    apply_devices(spec)
except AssertionError as exc:
    print("late:", exc)
"""


def test_a_process_that_applies_cpu_before_jax_starts_gets_the_cpu_and_cannot_change_it_later():
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, "cpu"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].split(" ", 2)[:2] == ["cpu", "''"] and lines[0].split(" ", 2)[2].startswith("cpu:0")
    assert lines[1] == "late: devices chosen after JAX's backend started"
