"""The demo's learners on a GPU host: each learner process's devices, from a given GPU count."""

from pathlib import Path

import pytest

from ddiloco.cli import build_parser
from ddiloco.cli.demo import config_from_args
from ddiloco.demo.config import DemoConfig
from ddiloco.demo.supervisor import LearnerProcess, device_plan_words, learner_argv
from ddiloco.learner.devices import device_env, learner_device_plan, parse_devices


def learner_envs(gpus: int, learners: int) -> list[dict[str, str]]:
    """What each learner process of a demo on a host with `gpus` GPUs sets before JAX starts: its
    command line as the supervisor builds it, read back as `ddiloco learner` reads it."""
    cfg = DemoConfig(learners=learners, gpus=gpus)
    plan = learner_device_plan(gpus, learners)
    envs = []
    for i in range(learners):
        argv = learner_argv(cfg, LearnerProcess(i), 8470, Path("token"), Path("work"), {}, plan[i])
        args = build_parser().parse_args(argv[3:])  # past `python -m ddiloco.cli`
        if args.devices is None and args.memory_fraction is None:
            envs.append({})
            continue
        spec = parse_devices(args.devices or "all")
        envs.append(device_env(spec, args.memory_fraction, inherited_visible=None))
    return envs


def test_on_a_cpu_host_the_learners_command_lines_are_as_before():
    assert learner_envs(0, 4) == [{}] * 4
    argv = learner_argv(DemoConfig(), LearnerProcess(1), 8470, Path("t"), Path("w"), {}, learner_device_plan(0, 4)[1])
    assert "--devices" not in argv and "--memory-fraction" not in argv


def test_with_several_gpus_each_learner_gets_its_own():
    assert learner_envs(4, 4) == [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(4)]
    assert learner_envs(8, 2) == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]


def test_with_one_gpu_every_learner_gets_a_memory_share_and_no_preallocation():
    shared = {"CUDA_VISIBLE_DEVICES": "0", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert learner_envs(1, 4) == [{**shared, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.212"}] * 4
    assert learner_envs(1, 2) == [{**shared, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.425"}] * 2


def test_with_fewer_gpus_than_learners_only_the_sharers_are_capped():
    envs = learner_envs(2, 3)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "0"]
    assert envs[1] == {"CUDA_VISIBLE_DEVICES": "1"}
    assert envs[0]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == envs[2]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.425"


def test_a_restarted_learner_keeps_its_gpu():
    plan = learner_device_plan(2, 4)
    again = LearnerProcess(3, restarts=2)
    argv = learner_argv(DemoConfig(), again, 1, Path("t"), Path("w"), {}, plan[again.index])
    assert argv[argv.index("--devices") + 1] == "1"


def test_the_plan_in_words_and_the_gpus_flag():
    words = device_plan_words(learner_device_plan(1, 2))
    assert words == "learner 0 on GPU 0 (memory fraction 0.425), learner 1 on GPU 0 (memory fraction 0.425)"
    assert config_from_args(build_parser().parse_args(["demo", "--gpus", "2"])).gpus == 2
    assert config_from_args(build_parser().parse_args(["demo"])).gpus is None
    with pytest.raises(ValueError, match="gpus must lie in"):
        DemoConfig(gpus=-1)
