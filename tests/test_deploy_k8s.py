"""deploy/k8s: every manifest validates offline against the Kubernetes schemas (strict:
unknown fields are errors), and what it says about forkd is true: the commands and flags
parse with the real CLI, every variable is a real setting, the probes' paths answer on a
real hub and controller, secret references, ports and selectors line up."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml
from deploy_support import (
    DEPLOY,
    controller_env_names,
    forkd_entry_point,
    hub_env_names,
    parse_args,
)
from net_support import free_port

K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.30"  # the oldest minor the manifests are checked against
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
Doc = dict[str, Any]


def docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_docs() -> list[Doc]:
    return [d for p in MANIFESTS for d in docs(p)]


def find(kind: str, name: str) -> Doc:
    (doc,) = [d for d in all_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(workload: Doc) -> Doc:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return dict(c)


def validate(doc: Doc) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_validates_against_the_schemas(path: Path) -> None:
    found = docs(path)
    assert found, f"{path.name} holds no manifest"
    for doc in found:
        validate(doc)


BROKEN: dict[str, tuple[str, Any]] = {
    "replicas not a number": ("spec.replicas", "three"),
    "misspelt field": ("spec.replica", 3),
    "probe without a handler port": ("container.readinessProbe.httpGet.port", None),
    "unknown volume source": ("spec.template.spec.volumes.0.hostpath", {"path": "/x"}),
}


def _set(doc: Doc, dotted: str, value: Any) -> None:
    if dotted.startswith("container."):
        target: Any = doc["spec"]["template"]["spec"]["containers"][0]
        dotted = dotted.removeprefix("container.")
    else:
        target = doc
    *parents, last = dotted.split(".")
    for key in parents:
        target = target[int(key)] if isinstance(target, list) else target[key]
    target[last] = value


@pytest.mark.parametrize("what", sorted(BROKEN))
def test_a_broken_manifest_is_refused(what: str) -> None:
    doc = copy.deepcopy(find("Deployment", "forkd-hub"))
    _set(doc, *BROKEN[what])
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(doc)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare for a network namespace without network")
def test_validation_needs_no_network() -> None:
    """The schemas are the package's own: validation works in a namespace with no network
    at all (not even loopback up), for every manifest and for a refused one."""
    code = (
        "import sys, yaml, kubernetes_validate as kv\n"
        "for path in sys.argv[1:]:\n"
        "    for doc in yaml.safe_load_all(open(path)):\n"
        f"        doc and kv.validate(doc, {KUBERNETES_VERSION!r}, strict=True)\n"
        "bad = {'apiVersion': 'v1', 'kind': 'Service', 'metadata': {'name': 'x'},"
        " 'spec': {'portz': []}}\n"
        "try:\n"
        f"    kv.validate(bad, {KUBERNETES_VERSION!r}, strict=True)\n"
        "except kv.ValidationError:\n"
        "    print('refused')\n"
    )
    p = subprocess.run(["unshare", "--net", sys.executable, "-P", "-c", code,
                        *map(str, MANIFESTS)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "refused", p.stdout + p.stderr[-2000:]


def test_kustomization_names_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    listed = set(kustomization["resources"])
    # secrets.example.yaml holds placeholders: created by hand, never applied as is
    assert listed == {p.name for p in MANIFESTS} - {"secrets.example.yaml"}
    images = {i["name"] for i in kustomization["images"]}
    for kind, name in (("Deployment", "forkd-hub"), ("DaemonSet", "forkd-node")):
        assert container(find(kind, name))["image"].split(":")[0] in images


WORKLOADS = {("Deployment", "forkd-hub"): ("hub", "serve"), ("DaemonSet", "forkd-node"): ("serve",)}


@pytest.mark.parametrize("workload", sorted(WORKLOADS), ids=lambda w: w[1])
def test_command_is_the_real_cli(workload: tuple[str, str]) -> None:
    c = container(find(*workload))
    path = WORKLOADS[workload]
    assert c["command"] == ["forkd", *path]
    parse_args(path, c.get("args", []))


@pytest.mark.parametrize("workload", sorted(WORKLOADS), ids=lambda w: w[1])
def test_env_is_real_settings(workload: tuple[str, str]) -> None:
    known = (hub_env_names() if workload[1] == "forkd-hub"
             else {n for n in controller_env_names() if not n.startswith("FORKD_HUB_")})
    names = [e["name"] for e in container(find(*workload))["env"]]
    assert sorted(set(names) - known) == []
    assert len(names) == len(set(names)), "a variable is set twice"


def test_secret_references_exist() -> None:
    """Every secretKeyRef names a Secret and key of secrets.example.yaml, in the workload's
    namespace."""
    secrets = {(d["metadata"]["namespace"], d["metadata"]["name"]): set(d["stringData"])
               for d in docs(K8S / "secrets.example.yaml")}
    for workload in WORKLOADS:
        doc = find(*workload)
        for e in container(doc)["env"]:
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref is None:
                continue
            keys = secrets.get((doc["metadata"]["namespace"], ref["name"]))
            assert keys is not None and ref["key"] in keys, f"{e['name']}: {ref} not defined"


def test_hub_settings_that_must_be_secret_come_from_secrets() -> None:
    env = {e["name"]: e for e in container(find("Deployment", "forkd-hub"))["env"]}
    for name in ("FORKD_HUB_DATABASE_URL", "AWS_SECRET_ACCESS_KEY", "FORKD_HUB_ADMIN_PASSWORD"):
        assert "secretKeyRef" in env[name]["valueFrom"], f"{name} is not from a Secret"
    assert env["FORKD_HUB_BLOB_BACKEND"]["value"] == "s3"
    assert find("Deployment", "forkd-hub")["spec"]["replicas"] == 3


@pytest.mark.parametrize("workload", sorted(WORKLOADS), ids=lambda w: w[1])
def test_labels_ports_and_probes_line_up(workload: tuple[str, str]) -> None:
    doc = find(*workload)
    labels = doc["spec"]["template"]["metadata"]["labels"]
    selector = doc["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    c = container(doc)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    listen_port = int(c["args"][c["args"].index("--listen") + 1].rpartition(":")[2])
    assert listen_port in ports.values()
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": c[probe]["httpGet"]["port"]}
        assert c[probe]["httpGet"]["port"] in ports
    (service,) = [d for d in all_docs() if d["kind"] == "Service"
                  and d["spec"]["selector"].items() <= labels.items()]
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports


def test_node_has_kvm_store_and_privileges() -> None:
    doc = find("DaemonSet", "forkd-node")
    volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container(doc)["volumeMounts"]}
    assert volumes[mounts["/dev/kvm"]]["hostPath"] == {"path": "/dev/kvm", "type": "CharDevice"}
    env = {e["name"]: e.get("value") for e in container(doc)["env"]}
    assert volumes[mounts[env["FORKD_HOME"]]]["hostPath"]["type"] == "DirectoryOrCreate"
    assert container(doc)["securityContext"] == {"privileged": True}


# -- the probes against the real servers, started as the manifests start them ---------



def _started(c: Doc, tmp: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The container's command line for this machine: forkd's real entry point, the
    --listen port on loopback and its paths under ``tmp``; the env's plain values too."""
    args = list(c.get("args", []))
    args[args.index("--listen") + 1] = f"127.0.0.1:{port}"
    if "--data" in args:
        args[args.index("--data") + 1] = str(tmp / "data")
    env = {**os.environ, "FORKD_HOME": str(tmp / "home"), "FORKD_RUN": str(tmp / "run"),
           "FORKD_CACHE": str(tmp / "cache"), "FORKD_CONTROLLER_TOKEN": "t" * 43}
    return [str(forkd_entry_point()), *c["command"][1:], *args], env


@pytest.mark.parametrize("workload", sorted(WORKLOADS), ids=lambda w: w[1])
def test_probe_path_answers_on_the_real_server(workload: tuple[str, str], tmp_path: Path) -> None:
    c = container(find(*workload))
    port = free_port()
    argv, env = _started(c, tmp_path, port)
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}{c['readinessProbe']['httpGet']['path']}"
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise AssertionError(f"{argv} exited {proc.returncode}: {err[-2000:]}")
            try:
                r = httpx.get(url, timeout=2)  # no token: what the kubelet sends
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, f"{url} did not answer in 120 s"
                time.sleep(0.2)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        assert httpx.get(url.replace("/healthz", "/nothing-here"), timeout=5).status_code >= 400
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# -- the hub with the Deployment's environment, on a real PostgreSQL and S3 API --------

def _hub_fixtures() -> None:
    """tests/hub's PostgreSQL fixture (a throwaway cluster), importable from here."""
    hub_tests = str(Path(__file__).resolve().parent / "hub")
    if hub_tests not in sys.path:
        sys.path.append(hub_tests)


_hub_fixtures()
import hub_support  # noqa: E402

postgres_server = hub_support.postgres_server  # the fixture, by its name


def _resolved_env(c: Doc, secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    """The container's env as the kubelet makes it: values, and secretKeyRefs from
    ``secrets`` ((name, key) → value); a missing optional key leaves the variable unset."""
    env: dict[str, str] = {}
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        ref = e["valueFrom"]["secretKeyRef"]
        if (ref["name"], ref["key"]) in secrets:
            env[e["name"]] = secrets[(ref["name"], ref["key"])]
        else:
            assert ref.get("optional"), f"{e['name']}: Secret key {ref} missing"
    return env


def test_hub_runs_on_postgresql_and_s3_with_the_deployments_env(
    tmp_path: Path, postgres_server: Any, moto_server: Any
) -> None:
    """The Deployment's command, args and env (its Secret filled with a throwaway
    PostgreSQL database and a moto S3 bucket): the hub starts, a pushed blob lands in the
    bucket and comes back, and no SQLite database appears in the data directory."""
    import hashlib

    from s3_support import MOTO_CREDENTIALS

    c = container(find("Deployment", "forkd-hub"))
    port = free_port()
    bucket = moto_server.new_bucket()
    secrets = {("forkd-hub", k): v for k, v in {
        "database-url": postgres_server(), "s3-bucket": bucket,
        "s3-endpoint-url": moto_server.url, "s3-region": "us-east-1",
        "s3-access-key-id": MOTO_CREDENTIALS["access_key_id"],
        "s3-secret-access-key": MOTO_CREDENTIALS["secret_access_key"],
        "admin-user": "admin", "admin-password": "admin-password-1",
        "public-url": f"http://127.0.0.1:{port}"}.items()}
    argv, _ = _started(c, tmp_path, port)
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("FORKD_", "AWS_"))}
    proc = subprocess.Popen(argv, env={**keep, **_resolved_env(c, secrets)},
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise AssertionError(f"the hub exited {proc.returncode}: {err[-2000:]}")
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the hub did not answer /healthz in 120 s"
            time.sleep(0.2)
        token = httpx.get(f"{url}/token", params={"scope": "repository:acme/app:pull,push"},
                          auth=("admin", "admin-password-1"), timeout=60).json()["token"]
        headers = {"Authorization": f"Bearer {token}"}
        blob = os.urandom(64 << 10)
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        r = httpx.post(f"{url}/v2/acme/app/blobs/uploads/", params={"digest": digest},
                       content=blob, headers=headers, timeout=60)
        assert r.status_code == 201, r.text
        assert httpx.get(f"{url}/v2/acme/app/blobs/{digest}", headers=headers,
                         timeout=60).content == blob
        keys = [o["Key"] for o in moto_server.client().list_objects_v2(Bucket=bucket)
                .get("Contents", [])]
        assert f"blobs/sha256/{digest.split(':')[1]}" in keys
        assert not (tmp_path / "data" / "hub.db").exists()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
