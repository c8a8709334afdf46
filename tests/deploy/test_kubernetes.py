"""deploy/kubernetes and its sharded variant deploy/kubernetes/sharded: every manifest valid against
the Kubernetes API's schemas (kubernetes-validate, which bundles them: no network), and wired
together as the deployment needs (docs/deployment.md)."""

import copy
import os
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
SHARDED = ROOT / "sharded"
KUBERNETES_VERSION = "1.30"  # the oldest release the manifests promise to fit (Indexed Jobs are GA since 1.24)


def documents(name, root=ROOT):
    return [doc for doc in yaml.safe_load_all((root / name).read_text()) if doc is not None]


def by_kind():
    out = {}
    for name in ("pvc.yaml", "syncer.yaml", "learners.yaml"):
        for doc in documents(name):
            out[doc["kind"]] = doc
    return out


@pytest.mark.parametrize("name", ["pvc.yaml", "syncer.yaml", "learners.yaml"])
def test_every_manifest_is_valid_against_the_api_schema_strictly(name):
    docs = documents(name)
    assert docs
    for doc in docs:
        # strict: a misspelt or misplaced field is an error, not silently ignored as by the API server
        assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_the_validator_catches_what_it_should():
    """The check above can fail: a field in the wrong place, a wrong type."""
    bad = by_kind()["Deployment"]
    bad["spec"]["template"]["spec"]["containers"][0]["port"] = 8470  # `ports`, misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)
    job = by_kind()["Job"]
    job["spec"]["completions"] = "four"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)


def _container(doc):
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


def _token_volume(doc):
    spec = doc["spec"]["template"]["spec"]
    (mount,) = [m for m in _container(doc)["volumeMounts"] if m["name"] == "token"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "token"]
    return mount, volume


def test_the_syncer_is_one_cpu_pod_on_its_checkpoint_volume_with_health_probes():
    kinds = by_kind()
    syncer = kinds["Deployment"]
    spec = syncer["spec"]
    assert (
        spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    )  # never two syncers on one checkpoint directory
    container = _container(syncer)
    env = {e["name"]: e["value"] for e in container["env"]}
    resources = container["resources"]
    assert "cpu" in resources["requests"] and not any("gpu" in key for part in resources.values() for key in part)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz" and container[probe]["httpGet"]["port"] == "syncer"
    ports = {p["name"]: str(p["containerPort"]) for p in container["ports"]}
    # the websocket's port, and the lane's fixed (a Service forwards only the ports it names)
    assert ports == {"syncer": env["DDILOCO_PORT"], "lane": env["DDILOCO_LANE_PORT"]}
    (ck,) = [m for m in container["volumeMounts"] if m["name"] == "checkpoints"]
    (claim,) = [v for v in spec["template"]["spec"]["volumes"] if v["name"] == "checkpoints"]
    assert claim["persistentVolumeClaim"]["claimName"] == kinds["PersistentVolumeClaim"]["metadata"]["name"]
    script = container["args"][0]
    assert f"--resume {ck['mountPath']}" in script and f"--checkpoint-dir {ck['mountPath']}" in script
    assert env["DDILOCO_HOST"] == "0.0.0.0"


def test_the_service_reaches_the_syncer_pod_at_the_address_learners_dial():
    kinds = by_kind()
    service, syncer, job = kinds["Service"], kinds["Deployment"], kinds["Job"]
    labels = syncer["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert syncer["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    port, lane = sorted(service["spec"]["ports"], key=lambda p: p["name"] != "syncer")
    assert port["targetPort"] == "syncer"
    # A learner dials the lane at the Service's address on the port the syncer names (GET /lane):
    # the Service's lane port is the container's.
    env = {e["name"]: e["value"] for e in _container(syncer)["env"]}
    assert lane["targetPort"] == "lane" and str(lane["port"]) == env["DDILOCO_LANE_PORT"]
    args = _container(job)["args"]
    assert args[args.index("--syncer") + 1] == f"ws://{service['metadata']['name']}:{port['port']}/ws"


def test_learners_are_an_indexed_job_one_gpu_each_restarted_in_place():
    job = by_kind()["Job"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert spec["backoffLimit"] >= spec["completions"]  # room for every learner to fail a few times
    assert spec["template"]["spec"]["restartPolicy"] == "OnFailure"
    container = _container(job)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = container["args"]
    assert args[args.index("--shard") + 1] == f"$(LEARNER_INDEX)/{spec['completions']}"
    (index,) = [e for e in container["env"] if e["name"] == "LEARNER_INDEX"]
    assert (
        index["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )


@pytest.mark.parametrize("kind", ["Deployment", "Job"])
def test_the_token_is_a_secret_mounted_as_a_file_only_its_owner_may_read(kind):
    doc = by_kind()[kind]
    mount, volume = _token_volume(doc)
    assert mount["readOnly"] is True
    assert volume["secret"]["secretName"] == "ddiloco-token" and volume["secret"]["defaultMode"] in (0o400, 0o600)
    (item,) = volume["secret"]["items"]
    path = f"{mount['mountPath']}/{item['path']}"
    container = _container(doc)
    given = [e.get("value") for e in container.get("env", [])] + container.get("args", [])
    assert path in given  # the command reads the token from that file, never from a variable or its arguments


def test_kustomize_makes_the_secret_from_a_file_that_is_never_committed():
    kustomization = documents("kustomization.yaml")[0]
    assert set(kustomization["resources"]) == {"pvc.yaml", "syncer.yaml", "learners.yaml"}
    (secret,) = kustomization["secretGenerator"]
    assert secret["name"] == "ddiloco-token" and secret["files"] == ["token"]
    assert kustomization["generatorOptions"]["disableNameSuffixHash"] is True  # the pods name it as is
    ignored = (ROOT.parents[1] / ".gitignore").read_text().splitlines()
    assert "deploy/kubernetes/token" in ignored


# ---- the sharded variant: a StatefulSet of syncer shards behind a headless Service ----

SHARDED_FILES = ("syncer.yaml", "learners.yaml")
RENDER_S_MAX = 30  # the container's start script runs two shell builtins and a stub: seconds at most


def sharded_by_kind():
    out = {}
    for name in SHARDED_FILES:
        for doc in documents(name, SHARDED):
            out[doc["kind"]] = doc
    return out


def _env(container):
    return {e["name"]: e for e in container["env"]}


@pytest.mark.parametrize("name", SHARDED_FILES)
def test_every_sharded_manifest_is_valid_against_the_api_schema_strictly(name):
    docs = documents(name, SHARDED)
    assert docs
    for doc in docs:
        assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_the_validator_catches_a_misplaced_field_in_the_statefulset():
    bad = sharded_by_kind()["StatefulSet"]
    bad["spec"]["volumeClaimTemplate"] = bad["spec"].pop("volumeClaimTemplates")  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_the_shards_are_a_statefulset_of_cpu_pods_each_on_its_own_volume_with_health_probes():
    shards = sharded_by_kind()["StatefulSet"]
    spec = shards["spec"]
    container = _container(shards)
    env = _env(container)
    assert spec["replicas"] == int(env["DDILOCO_SHARDS"]["value"]) >= 2
    assert spec["replicas"] <= int(env["DDILOCO_FRAGMENTS"]["value"])  # a shard owns one fragment at least
    assert spec["podManagementPolicy"] == "Parallel"  # the shards do not wait on one another
    resources = container["resources"]
    assert "cpu" in resources["requests"] and not any("gpu" in key for part in resources.values() for key in part)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz" and container[probe]["httpGet"]["port"] == "syncer"
    (port,) = container["ports"]
    assert port["name"] == "syncer" and str(port["containerPort"]) == env["DDILOCO_PORT"]["value"]
    # a claim per shard, from the template: no volume named checkpoints that every pod would share
    (claim,) = spec["volumeClaimTemplates"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert mount["mountPath"] and claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert not [v for v in spec["template"]["spec"]["volumes"] if v["name"] == claim["metadata"]["name"]]
    assert env["DDILOCO_HOST"]["value"] == "0.0.0.0"
    # the shard index comes from the pod's own name, whose last part is its ordinal
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "DDILOCO_SHARD" not in env  # one index for every pod would make every pod the same shard


def render_start(tmp_path, pod_name, checkpoint_files=()):
    """Run the shard container's start script with a stub `ddiloco` that prints its arguments, the
    volume's mount path standing for a directory of tmp_path; the arguments it ran with."""
    shards = sharded_by_kind()["StatefulSet"]
    container = _container(shards)
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "checkpoints"]
    volume = tmp_path / "volume"
    for name in checkpoint_files:
        (volume / name).parent.mkdir(parents=True, exist_ok=True)
        (volume / name).write_text("")
    stub = tmp_path / "bin" / "ddiloco"
    stub.parent.mkdir(parents=True)
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    stub.chmod(0o755)
    assert container["command"] == ["/bin/sh", "-c"]
    (script,) = container["args"]
    assert mount["mountPath"] in script
    env = {"PATH": f"{stub.parent}{os.pathsep}{os.environ['PATH']}", "POD_NAME": pod_name}
    out = subprocess.run(
        ["/bin/sh", "-c", script.replace(mount["mountPath"], str(volume))],
        env=env,
        capture_output=True,
        text=True,
        timeout=RENDER_S_MAX,
        check=True,
    )
    return out.stdout.splitlines(), volume


def test_each_shard_takes_its_index_from_its_ordinal_and_resumes_only_its_own_checkpoints(tmp_path):
    name = sharded_by_kind()["StatefulSet"]["metadata"]["name"]
    # shard 1 was checkpointed before its pod was replaced; shard 0 never was
    args, volume = render_start(tmp_path, f"{name}-1", checkpoint_files=["shard-1/ckpt-00000012"])
    assert args == ["syncer", "--shard", "1", "--resume", str(volume / "shard-1")]
    fresh, volume = render_start(tmp_path / "again", f"{name}-0", checkpoint_files=["shard-1/ckpt-00000012"])
    assert fresh == ["syncer", "--shard", "0", "--checkpoint-dir", str(volume / "shard-0")]


def test_the_headless_service_names_every_shard_and_the_learners_dial_them_all():
    kinds = sharded_by_kind()
    service, shards, job = kinds["Service"], kinds["StatefulSet"], kinds["Job"]
    assert service["spec"]["clusterIP"] == "None"  # headless: a DNS name per pod
    assert shards["spec"]["serviceName"] == service["metadata"]["name"]
    labels = shards["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert shards["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "syncer"
    args = _container(job)["args"]
    urls = args[args.index("--syncer") + 1].split(",")
    name, svc = shards["metadata"]["name"], service["metadata"]["name"]
    assert sorted(urls) == sorted(f"ws://{name}-{i}.{svc}:{port['port']}/ws" for i in range(shards["spec"]["replicas"]))


def test_the_sharded_learners_are_the_default_learners_but_for_the_syncer_urls():
    default, sharded = by_kind()["Job"], sharded_by_kind()["Job"]
    args = _container(sharded)["args"]
    at = args.index("--syncer") + 1
    assert "," in args[at]
    unsharded = copy.deepcopy(sharded)
    _container(unsharded)["args"][at] = _container(default)["args"][at]
    assert unsharded == default  # one Job, kept in step with learners.yaml


def test_the_sharded_selector_never_takes_the_single_syncers_pods():
    single = by_kind()["Deployment"]["spec"]["selector"]["matchLabels"]
    shards = sharded_by_kind()["StatefulSet"]["spec"]["selector"]["matchLabels"]
    assert single != shards and not set(shards.items()) <= set(single.items())


@pytest.mark.parametrize("kind", ["StatefulSet", "Job"])
def test_the_sharded_token_is_a_secret_mounted_as_a_file_only_its_owner_may_read(kind):
    doc = sharded_by_kind()[kind]
    mount, volume = _token_volume(doc)
    assert mount["readOnly"] is True
    assert volume["secret"]["secretName"] == "ddiloco-token" and volume["secret"]["defaultMode"] in (0o400, 0o600)
    (item,) = volume["secret"]["items"]
    path = f"{mount['mountPath']}/{item['path']}"
    container = _container(doc)
    given = [e.get("value") for e in container.get("env", [])] + container.get("args", [])
    assert path in given


def test_the_sharded_kustomization_makes_the_secret_from_its_own_file_never_committed():
    kustomization = documents("kustomization.yaml", SHARDED)[0]
    assert set(kustomization["resources"]) == set(SHARDED_FILES)
    (secret,) = kustomization["secretGenerator"]
    assert secret["name"] == "ddiloco-token" and secret["files"] == ["token"]
    assert kustomization["generatorOptions"]["disableNameSuffixHash"] is True
    ignored = (ROOT.parents[1] / ".gitignore").read_text().splitlines()
    assert "deploy/kubernetes/sharded/token" in ignored
