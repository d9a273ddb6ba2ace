"""``deploy/k8s``: every manifest validates offline against the Kubernetes schemas, and the pieces fit.

``kubernetes-validate`` ships the OpenAPI schemas of each Kubernetes release;
strict mode also refuses fields the schema does not know (a typo in a probe
or a volume is an error, not a silently ignored key). Beyond the schema: the
objects refer to each other by names that exist, the server's arguments
parse with ladle's own command line, and the probes hit ladle's endpoints
(every probe the gRPC health service, not the HTTP face).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from ladle.proto.rpc import SERVICE
from ladle.service.cli import build_parser

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
VERSION = "1.30.0"  # the oldest release the manifests promise to work on (policy/v1, Indexed Jobs)


def documents() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents() if d["kind"] == kind}


def test_there_are_manifests() -> None:
    kinds = {d["kind"] for d in documents()}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "StatefulSet", "Job"} <= kinds


@pytest.mark.parametrize("version", [VERSION, kubernetes_validate.latest_version()])
def test_every_manifest_validates(version: str) -> None:
    for doc in documents():
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_catches_a_typo() -> None:
    deployment = copy.deepcopy(by_kind("Deployment")["ladle"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSION, strict=True)


def pod_specs() -> list[dict[str, Any]]:
    return [
        doc["spec"]["template"]["spec"]
        for doc in documents()
        if doc["kind"] in ("Deployment", "StatefulSet", "Job")
    ]


def test_names_refer_to_objects_that_exist() -> None:
    config_maps, claims = by_kind("ConfigMap"), by_kind("PersistentVolumeClaim")
    secrets = by_kind("Secret")
    for spec in pod_specs():
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
        for container in spec["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["stringData"]


def test_services_select_pods_and_name_their_ports() -> None:
    workloads = [d for d in documents() if d["kind"] in ("Deployment", "StatefulSet")]
    for name, service in by_kind("Service").items():
        selector = service["spec"]["selector"]
        matches = [
            w for w in workloads if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert matches, f"service {name} selects no pods"
        ports = {
            p["name"]
            for w in matches
            for c in w["spec"]["template"]["spec"]["containers"]
            for p in c["ports"]
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"service {name}: no container port {port['targetPort']}"


def test_the_server_runs_ladle_serve_with_probes_on_its_endpoints() -> None:
    deployment = by_kind("Deployment")["ladle"]
    assert deployment["spec"]["replicas"] >= 2
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"][1:])  # a wrong flag fails here
    assert args.command == "serve"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == args.http_port
    assert ports["grpc"] == args.grpc_port
    assert "requests" in container["resources"]
    pdb = by_kind("PodDisruptionBudget")["ladle"]
    assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]


def test_every_probe_asks_the_grpc_health_service() -> None:
    """Not the HTTP face: whoever fills its 128 connections would get the pod restarted (liveness) or
    taken out of the Service (readiness)."""
    container = by_kind("Deployment")["ladle"]["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"][1:])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("livenessProbe", "startupProbe", "readinessProbe"):
        assert "httpGet" not in container[probe], f"{probe} goes through the HTTP face"
        assert container[probe]["grpc"]["port"] == args.grpc_port == ports["grpc"], probe
    # the standard health service, which ladle answers without a token: "" is the process (restart
    # it when that fails), ladle.v1.BatchService its readiness (the dataset and the cursor store)
    assert container["livenessProbe"]["grpc"].get("service", "") == ""
    assert container["startupProbe"]["grpc"].get("service", "") == ""
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE


def test_the_trainer_job_sets_rank_and_world_size() -> None:
    job = by_kind("Job")["ladle-trainer"]
    assert job["spec"]["completionMode"] == "Indexed"
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "job-completion-index" in env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert int(env["WORLD_SIZE"]["value"]) == job["spec"]["completions"]


def test_the_server_and_the_trainers_get_the_token_from_a_secret() -> None:
    """The server listens on 0.0.0.0, which ladle refuses without a token."""
    secrets = by_kind("Secret")
    for kind, name in (("Deployment", "ladle"), ("Job", "ladle-trainer")):
        container = by_kind(kind)[name]["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        ref = env["LADLE_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "ladle-token", "key": "token"}
        assert "token" in secrets["ladle-token"]["stringData"]
    server = by_kind("Deployment")["ladle"]["spec"]["template"]["spec"]["containers"][0]
    assert "--host=0.0.0.0" in server["args"]
    assert "--insecure" not in server["args"]


def containers_of(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def test_every_workload_passes_pod_security_restricted() -> None:
    """What the "restricted" Pod Security Standard demands of a pod, checked on every workload."""
    for spec in pod_specs():
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True, "the pod may run as root"
        assert pod.get("seccompProfile", {}).get("type") in ("RuntimeDefault", "Localhost"), "no seccomp"
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(host), f"the pod shares the node's {host}"
        for container in containers_of(spec):
            own = container.get("securityContext", {})
            name = container["name"]
            assert own.get("allowPrivilegeEscalation") is False, f"{name} may escalate privileges"
            assert own.get("capabilities", {}).get("drop") == ["ALL"], f"{name} keeps capabilities"
            assert not own.get("capabilities", {}).get("add"), f"{name} adds capabilities"
            assert own.get("privileged") is not True, f"{name} is privileged"
            assert own.get("runAsNonRoot", True) is True, f"{name} may run as root"
            assert own.get("runAsUser", pod.get("runAsUser", 1)) != 0, f"{name} runs as root"


def test_a_statefulsets_service_name_is_a_headless_service() -> None:
    services = by_kind("Service")
    for name, sts in by_kind("StatefulSet").items():
        governing = services.get(sts["spec"]["serviceName"])
        assert governing is not None, f"{name}: serviceName names no Service"
        assert governing["spec"].get("clusterIP") == "None", f"{name}: its serviceName is not headless"
