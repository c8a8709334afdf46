"""`ddiloco learner` processes against a `ddiloco syncer` process, as a user runs them."""

import json
import math
import signal
import ssl
import subprocess
import sys
import threading
import urllib.request


def learner(port, tmp_path, shard, steps=100, token=True, *extra, cache_dir):
    args = [
        sys.executable,
        "-m",
        "ddiloco.cli",
        "learner",
        "--syncer",
        f"ws://127.0.0.1:{port}/ws",
        "--shard",
        shard,
        "--steps",
        str(steps),
        "--batch",
        "4",
        "--speed",
        "0.25",
        "--cache-dir",
        str(cache_dir),
        "--seed",
        shard[0],
        *extra,
    ]
    if token:
        args += ["--token-file", str(tmp_path / "token")]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def drain(proc, sink):
    """Read a child's stderr so it never blocks on a full pipe."""
    threading.Thread(target=lambda: sink.extend(proc.stderr), daemon=True).start()


def test_two_learner_processes_train_through_the_syncer(tmp_path, start_syncer, jax_cache_dir):
    syncer, port, log = start_syncer(tmp_path, "--fragments", "4", "--period", "4")
    drain(syncer, log)
    try:
        learners = [learner(port, tmp_path, f"{i}/2", cache_dir=jax_cache_dir) for i in range(2)]
        outs = [p.communicate(timeout=300) for p in learners]
        for p, (out, err) in zip(learners, outs):
            assert p.returncode == 0, err[-2000:]
            summary = json.loads(out.strip().splitlines()[-1])
            assert summary["last_step"] >= 100 and summary["applied"] > 0 and math.isfinite(summary["loss"])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as r:
            status = json.loads(r.read())
        assert status["merges"] > 0 and status["init_source"].startswith("learner ")
    finally:
        syncer.send_signal(signal.SIGTERM)
        assert syncer.wait(60) == 0
    assert any("checkpoint" in line for line in log)


def test_wrong_token_and_wrong_url_are_clear(tmp_path, start_syncer, jax_cache_dir):
    syncer, port, log = start_syncer(tmp_path)
    drain(syncer, log)
    try:
        (tmp_path / "bad").write_text("not-the-right-token-0123\n")
        bad = subprocess.run(
            [
                sys.executable,
                "-m",
                "ddiloco.cli",
                "learner",
                "--syncer",
                f"ws://127.0.0.1:{port}/ws",
                "--token-file",
                str(tmp_path / "bad"),
                "--steps",
                "5",
                "--cache-dir",
                str(jax_cache_dir),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bad.returncode == 1 and "refused the token" in bad.stderr
    finally:
        syncer.send_signal(signal.SIGTERM)
        syncer.wait(60)


def test_a_learner_trains_over_wss_with_the_ca_and_is_refused_without_it(
    tmp_path, start_syncer, self_signed_cert, jax_cache_dir
):
    cert, key = self_signed_cert
    syncer, port, log = start_syncer(
        tmp_path, "--fragments", "2", "--period", "2", "--tls-cert", str(cert), "--tls-key", str(key)
    )
    drain(syncer, log)
    url = f"wss://127.0.0.1:{port}/ws"
    common = [
        sys.executable,
        "-m",
        "ddiloco.cli",
        "learner",
        "--syncer",
        url,
        "--token-file",
        str(tmp_path / "token"),
        "--batch",
        "4",
        "--cache-dir",
        str(jax_cache_dir),
    ]
    try:
        refused = subprocess.run([*common, "--steps", "5"], capture_output=True, text=True, timeout=300, check=False)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        assert f"the certificate of the syncer at {url} is not trusted by the system's CAs" in refused.stderr
        trained = subprocess.run(
            [*common, "--steps", "100", "--tls-ca", str(cert)], capture_output=True, text=True, timeout=300, check=False
        )
        assert trained.returncode == 0, trained.stderr[-2000:]
        summary = json.loads(trained.stdout.strip().splitlines()[-1])
        assert summary["last_step"] >= 100 and summary["applied"] > 0 and math.isfinite(summary["loss"])
        context = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/status", timeout=5, context=context) as r:
            assert json.loads(r.read())["merges"] > 0
    finally:
        syncer.send_signal(signal.SIGTERM)
        assert syncer.wait(60) == 0


def test_a_syncer_with_more_fragments_than_the_model_has_tensors_is_one_line_on_both_sides(
    tmp_path, start_syncer, jax_cache_dir
):
    syncer, port, log = start_syncer(tmp_path, "--fragments", "16", "--period", "16")  # the reference model: 15 tensors
    drain(syncer, log)
    try:
        refused = subprocess.run(
            [
                sys.executable,
                "-m",
                "ddiloco.cli",
                "learner",
                "--syncer",
                f"ws://127.0.0.1:{port}/ws",
                "--token-file",
                str(tmp_path / "token"),
                "--name",
                "small",
                "--steps",
                "5",
                "--cache-dir",
                str(jax_cache_dir),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        syncer.send_signal(signal.SIGTERM)
        assert syncer.wait(60) == 0
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    said = [line for line in refused.stderr.splitlines() if line.startswith("ddiloco learner:")]
    assert said == [
        f"ddiloco learner: the syncer at ws://127.0.0.1:{port}/ws refused this learner (bad_layout): "
        "the syncer splits the model into 16 fragments but it has 15 tensors: "
        "start the syncer with --fragments 15 or fewer"
    ]
    (warned,) = [line for line in log if "WARNING" in line and "refused learner" in line]
    assert "'small'" in warned and "15 tensors" in warned and "--fragments 15 or fewer" in warned, log


def test_a_learner_joining_after_another_spent_its_budget_trains_its_own_steps(tmp_path, start_syncer, jax_cache_dir):
    syncer, port, log = start_syncer(tmp_path, "--fragments", "4", "--period", "4")
    drain(syncer, log)
    steps = 30
    try:
        first = learner(port, tmp_path, "0/2", steps=steps, cache_dir=jax_cache_dir)
        out, err = first.communicate(timeout=300)
        assert first.returncode == 0, err[-2000:]
        spent = json.loads(out.strip().splitlines()[-1])
        assert spent["steps"] == steps and spent["last_step"] >= steps
        # joins at the global step the first one left
        late = learner(
            port, tmp_path, "1/2", steps, True, "--log-file", str(tmp_path / "late.jsonl"), cache_dir=jax_cache_dir
        )
        out, err = late.communicate(timeout=300)
        assert late.returncode == 0, err[-2000:]
    finally:
        syncer.send_signal(signal.SIGTERM)
        assert syncer.wait(60) == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == steps and summary["last_step"] >= spent["last_step"] + steps
    # Trained, not its random initialisation: it took the syncer's state (every fragment), merged
    # versions of its own pushes arrived, and its loss is well below a uniform guess over the
    # 256 byte values (ln 256 = 5.55, where a freshly initialised model starts).
    assert summary["recovered_from"] == "syncer" and summary["caught_up_s"] is not None and summary["applied"] > 4
    assert summary["loss"] < math.log(256) - 1.0, summary
    # What it did before its first step, said as it happened: in its log, and in its JSON lines
    assert err.index("compiling the training step") < err.index("compiled in ")
    lines = [json.loads(line) for line in (tmp_path / "late.jsonl").read_text().splitlines()]
    assert lines[0] == {"phase": "compiling"} and lines[1]["phase"] == "compiled" and lines[1]["seconds"] > 0
    assert all("step" in line for line in lines[2:]) and len(lines[2:]) == steps // 5


def test_bad_devices_are_one_line_before_anything_starts(capsys):
    from ddiloco.cli import main

    assert main(["learner", "--syncer", "ws://127.0.0.1:9/ws", "--devices", "0,zero"]) == 2
    assert "--devices '0,zero': expected all, cpu, or GPU indices such as 0 or 0,1" in capsys.readouterr().err
    assert main(["learner", "--syncer", "ws://127.0.0.1:9/ws", "--devices", "cpu", "--memory-fraction", "0.5"]) == 2
    assert "--memory-fraction caps GPU memory" in capsys.readouterr().err


def test_a_gpu_asked_for_on_a_host_jax_sees_none_on_is_refused_before_joining():
    # No syncer listens at this URL: the learner must stop at its devices, before it tries to join.
    done = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", "learner", "--syncer", "ws://127.0.0.1:9/ws", "--devices", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--devices 0: asked for 1 GPU(s), JAX sees cpu:0" in done.stderr


def test_a_learner_on_devices_cpu_trains_and_says_so(tmp_path, start_syncer, jax_cache_dir):
    syncer, port, log = start_syncer(tmp_path, "--fragments", "2", "--period", "2")
    drain(syncer, log)
    try:
        proc = learner(port, tmp_path, "0/1", 10, True, "--devices", "cpu", cache_dir=jax_cache_dir)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        assert "devices cpu: cpu:0" in err
        assert json.loads(out.strip().splitlines()[-1])["last_step"] >= 10
    finally:
        syncer.send_signal(signal.SIGTERM)
        syncer.wait(60)


def test_a_list_of_shard_urls_with_a_hole_is_refused_at_once():
    got = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", "learner", "--syncer", "ws://127.0.0.1:1/ws,,ws://127.0.0.1:2/ws"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == 2 and "an empty syncer URL" in got.stderr, got.stderr
