"""deploy/kubernetes: every manifest valid against the Kubernetes API's schemas (kubernetes-validate,
which bundles them: no network), and wired together as the deployment needs (docs/deployment.md)."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30"  # the oldest release the manifests promise to fit (Indexed Jobs are GA since 1.24)


def documents(name):
    return [doc for doc in yaml.safe_load_all((ROOT / name).read_text()) if doc is not None]


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
    (port,) = container["ports"]
    assert port["name"] == "syncer" and str(port["containerPort"]) == env["DDILOCO_PORT"]
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
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "syncer"
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
