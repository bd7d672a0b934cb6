"""The Kubernetes manifests in deploy/k8s: official schemas (strict) plus the cross-references a schema cannot see.

No cluster runs here. Each object is checked against the Kubernetes JSON schema
(kubernetes-validate, strict: unknown fields are errors) at the oldest and the
newest Kubernetes version we claim; then against what a schema cannot know:
probe ports that name no container port, Service target ports and selectors that
match no pod, mounts of undeclared volumes, a listen address a pod cannot be
reached on, arguments `fedge verifier serve` would reject, a Secret other than
the one docs/fleet.md tells you to create, a secret in an environment variable
rather than a mounted file, a listener without TLS or per-device credentials, Ray
without token authentication, Ray's ports open beyond the fleet's own pods. Every
check has a test that breaks the manifest on purpose and expects the check to name
the fault.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import os
import re
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import click
import jsonschema
import kubernetes_validate
import pydantic
import pytest
import ray
import typer
import yaml

from fedge.edge.cli import verifier_app
from fedge.edge.proto import verifier_pb2
from fedge.edge.verifier.server import ServerConfig

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
DOCS = REPO / "docs" / "fleet.md"
K8S_VERSIONS = ("1.29", "1.37")  # gRPC probes are GA from 1.27; 1.37 is the newest schema shipped
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
HEALTH_SERVICES = ("", SERVICE_NAME)  # what the verifier's grpc.health.v1 servicer reports
Obj = dict[str, Any]


@pytest.fixture(scope="module", autouse=True)
def _schemas_read_once() -> Iterator[None]:
    """kubernetes-validate parses its schema files on every call; read each once per module."""
    utils = kubernetes_validate.utils
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(utils, "schema_contents", functools.cache(utils.schema_contents))
        yield


def load(name: str) -> list[Obj]:
    """The objects of one manifest file."""
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def schema_problems(obj: Obj) -> list[str]:
    """Strict validation against the official schema at each claimed Kubernetes version."""
    problems = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            where = ".".join(str(p) for p in err.path)
            problems.append(f"{obj['kind']} (k8s {version}) {where}: {err.message}")
    return problems


def _probes(container: Obj) -> Iterator[tuple[str, Obj]]:
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in container:
            yield kind, container[kind]


def container_problems(container: Obj, volumes: set[str]) -> list[str]:
    """Probes aim at declared ports and the health service, mounts at declared volumes, an image is set."""
    name = container["name"]
    problems = [] if container.get("image") else [f"container {name} has no image"]
    ports = {p["containerPort"] for p in container.get("ports", [])}
    port_names = {p["name"] for p in container.get("ports", []) if "name" in p}
    for kind, probe in _probes(container):
        if "grpc" in probe:
            if probe["grpc"]["port"] not in ports:
                problems.append(
                    f"{name}.{kind}.grpc.port {probe['grpc']['port']} is no containerPort"
                )
            service = probe["grpc"].get("service", "")
            if service not in HEALTH_SERVICES:
                problems.append(
                    f"{name}.{kind}.grpc.service {service!r} is not in {HEALTH_SERVICES}"
                )
        for action in ("httpGet", "tcpSocket"):
            port = probe.get(action, {}).get("port")
            if port is not None and port not in ports | port_names:
                problems.append(f"{name}.{kind}.{action}.port {port!r} is no container port")
    for mount in container.get("volumeMounts", []):
        if mount["name"] not in volumes:
            problems.append(
                f"{name} mounts volume {mount['name']!r}, which the pod does not declare"
            )
    return problems


def pod_problems(template: Obj) -> list[str]:
    """A pod template: non-root, and every container consistent with the pod's volumes."""
    spec = template["spec"]
    volumes = {v["name"] for v in spec.get("volumes", [])}
    security = spec.get("securityContext", {})
    problems = [] if security.get("runAsNonRoot") else ["pod does not set runAsNonRoot: true"]
    if security.get("runAsUser", 1) == 0:
        problems.append("pod runs as uid 0")
    for container in spec["containers"]:
        problems += container_problems(container, volumes)
    return problems


def service_problems(service: Obj, template: Obj) -> list[str]:
    """The Service selects the pods and its named target ports exist on them."""
    labels = template["metadata"].get("labels", {})
    selector = service["spec"].get("selector", {})
    problems = []
    if not selector or any(labels.get(k) != v for k, v in selector.items()):
        problems.append(f"Service selector {selector} does not select pods labelled {labels}")
    names = {p.get("name") for c in template["spec"]["containers"] for p in c.get("ports", [])}
    numbers = {p["containerPort"] for c in template["spec"]["containers"] for p in c["ports"]}
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        if target not in names | numbers:
            problems.append(f"Service port {port.get('name')} targets {target!r}: no such pod port")
    return problems


def deployment_problems(deployment: Obj) -> list[str]:
    """The selector matches the template's labels; then the pod checks."""
    labels = deployment["spec"]["template"]["metadata"].get("labels", {})
    selector = deployment["spec"]["selector"].get("matchLabels", {})
    problems = []
    if any(labels.get(k) != v for k, v in selector.items()):
        problems.append(f"Deployment selector {selector} does not match template labels {labels}")
    return problems + pod_problems(deployment["spec"]["template"])


def serve_config(container: Obj) -> ServerConfig:
    """The ServerConfig the real `fedge verifier serve` builds from the container's args and env.

    Runs the command itself with `serve` replaced by a recorder, so every check the CLI
    and ServerConfig make applies (unknown flags, bad values, inconsistent limits).
    """
    if container.get("command", [])[:3] != ["fedge", "verifier", "serve"]:
        raise click.UsageError(f"command {container.get('command')} is not `fedge verifier serve`")
    command: click.Command | None = typer.main.get_command(verifier_app)
    if isinstance(command, click.Group):  # a lone command is collapsed into the app by Typer
        command = command.get_command(click.Context(command), "serve")
    assert command is not None and command.name == "serve"
    built: list[ServerConfig] = []

    def record(config: ServerConfig, **_: object) -> None:
        built.append(config)

    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    with mock.patch.dict(os.environ, env), mock.patch("fedge.edge.verifier.server.serve", record):
        command.main(list(container.get("args", [])), prog_name="serve", standalone_mode=False)
    (config,) = built
    return config


def verifier_problems(deployment: Obj) -> list[str]:
    """`fedge verifier serve` in a pod: parsable args, reachable address, probe on its port, token, drain."""
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    try:
        config = serve_config(container)
    except click.ClickException as err:
        return [f"container args rejected by `fedge verifier serve`: {err.format_message()}"]
    except ValueError as err:
        return [f"`fedge verifier serve` refuses the container's settings: {err}"]
    problems = []
    if config.host in LOOPBACK:
        problems.append(f"--host={config.host} is loopback: probes and the Service cannot reach it")
    grpc_ports = {p["containerPort"] for p in container["ports"] if p.get("name") == "grpc"}
    if grpc_ports != {config.port}:
        problems.append(f"--port={config.port} but the container's grpc port is {grpc_ports}")
    if config.tls_cert is None or config.credentials_file is None:
        problems.append("the verifier must serve TLS (--tls-cert/--tls-key) and --credentials")
    probe_ports = {probe.get("grpc", {}).get("port") for _, probe in _probes(container)}
    if config.port in probe_ports:
        problems.append(f"a gRPC probe on the TLS port {config.port}: kubelet probes cannot TLS")
    if config.health_port is None or probe_ports != {config.health_port}:
        problems.append(f"gRPC probes must use --health-port, got ports {probe_ports}")
    files = {
        "--credentials": config.credentials_file,
        "--tls-cert": config.tls_cert,
        "--tls-key": config.tls_key,
    }
    problems += secret_problems(pod, container, files)
    readiness = container.get("readinessProbe", {}).get("grpc", {}).get("service")
    if readiness != SERVICE_NAME:
        problems.append(f"readinessProbe must check service {SERVICE_NAME!r}, got {readiness!r}")
    drain_s = config.drain_notice_s + config.grace_s  # NOT_SERVING notice, then in-flight grace
    if pod.get("terminationGracePeriodSeconds", 30) <= drain_s:
        problems.append(f"terminationGracePeriodSeconds must exceed the {drain_s:.0f} s drain")
    return problems


def secret_problems(pod: Obj, container: Obj, files: dict[str, Any]) -> list[str]:
    """No secret in the environment; each secret file lies in a volume of a documented Secret."""
    problems = [
        f"{container['name']} takes {e['name']} from a Secret in its environment: mount it as a file"
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    ]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    for flag, path in files.items():
        if path is None:
            continue
        mount = next((m for m in mounts if str(path).startswith(m.rstrip("/") + "/")), None)
        secret = volumes.get(mounts[mount], {}).get("secret", {}) if mount else {}
        if secret.get("secretName") not in documented_secrets():
            problems.append(
                f"{flag} {path} is not in a volume of a Secret docs/fleet.md creates "
                f"({sorted(documented_secrets())})"
            )
    return problems


def documented_secrets() -> set[str]:
    """The Secrets docs/fleet.md tells you to create (`kubectl create secret ... NAME`)."""
    names = set(re.findall(r"kubectl create secret (?:generic|tls) (\S+)", DOCS.read_text()))
    assert names, "docs/fleet.md must show `kubectl create secret ...` for the fedge Secrets"
    return names


def all_problems(objects: list[Obj]) -> list[str]:
    """Every problem of the verifier shape: schema, cross-references, verifier-specific."""
    problems = [p for obj in objects for p in schema_problems(obj)]
    if problems:
        return problems
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    problems += deployment_problems(deployment) + verifier_problems(deployment)
    for service in (o for o in objects if o["kind"] == "Service"):
        problems += service_problems(service, deployment["spec"]["template"])
    return problems


def verifier_shape() -> list[Obj]:
    return load("verifier.yaml") + load("models-pvc.yaml")


# ---------------------------------------------------------------------------------- tests
def test_verifier_manifests_pass_every_check() -> None:
    """TLS, per-device credentials and every secret as a mounted file, probes on the health port.

    Main's manifest fails it: a plaintext listener, one shared token in the environment, probes
    on the gRPC port (checked: four problems named)."""
    objects = verifier_shape()
    assert [o["kind"] for o in objects] == ["Deployment", "Service", "PersistentVolumeClaim"]
    assert all_problems(objects) == []


def test_model_volume_is_the_documented_claim() -> None:
    (deployment, _, claim) = verifier_shape()
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    claims = [
        v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v
    ]
    assert claims == [claim["metadata"]["name"]]
    config = serve_config(deployment["spec"]["template"]["spec"]["containers"][0])
    assert config.model_dir.is_relative_to("/models")
    assert config.rate_limits.enabled


def test_image_user_is_the_manifests_user() -> None:
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    users = re.findall(r"^USER (\d+)", dockerfile, flags=re.M)
    (deployment, *_) = verifier_shape()
    assert users and {int(u) for u in users} == {
        deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    }


def _container(objects: list[Obj]) -> Obj:
    return objects[0]["spec"]["template"]["spec"]["containers"][0]


def _set_arg(flag: str, value: str) -> Callable[[list[Obj]], None]:
    def mutate(objects: list[Obj]) -> None:
        args = _container(objects)["args"]
        args[:] = [a for a in args if not a.startswith(flag + "=")] + [f"{flag}={value}"]

    return mutate


BREAKAGES: dict[str, tuple[Callable[[list[Obj]], None], str]] = {
    "probe port not a container port": (
        lambda o: _container(o)["readinessProbe"]["grpc"].update(port=50062),
        "readinessProbe.grpc.port 50062 is no containerPort",
    ),
    "probe on the TLS port": (
        lambda o: _container(o)["livenessProbe"]["grpc"].update(port=50061),
        "kubelet probes cannot TLS",
    ),
    "plaintext listener": (
        lambda o: _container(o)["args"].__setitem__(
            slice(None), [a for a in _container(o)["args"] if not a.startswith("--tls-")]
        ),
        "must serve TLS",
    ),
    "no per-device credentials": (
        lambda o: _container(o)["args"].__setitem__(
            slice(None), [a for a in _container(o)["args"] if not a.startswith("--credentials")]
        ),
        "--credentials",
    ),
    "credentials file outside a Secret volume": (
        _set_arg("--credentials", "/models/devices"),
        "--credentials /models/devices is not in a volume of a Secret",
    ),
    "probe port given by name": (
        lambda o: _container(o)["livenessProbe"]["grpc"].update(port="grpc"),
        "'grpc' is not of type 'integer'",
    ),
    "probe asks an unknown health service": (
        lambda o: _container(o)["readinessProbe"]["grpc"].update(service="fedge.Verifier"),
        "grpc.service 'fedge.Verifier' is not in",
    ),
    "Service targets a misspelt port name": (
        lambda o: o[1]["spec"]["ports"][0].update(targetPort="gprc"),
        "targets 'gprc': no such pod port",
    ),
    "Service selects other pods": (
        lambda o: o[1]["spec"]["selector"].update({"app.kubernetes.io/name": "verifier"}),
        "does not select pods",
    ),
    "misspelt field": (
        lambda o: _container(o).update(livenesProbe=_container(o).pop("livenessProbe")),
        "'livenesProbe' was unexpected",
    ),
    "containers missing": (
        lambda o: o[0]["spec"]["template"]["spec"].pop("containers"),
        "'containers' is a required property",
    ),
    "image missing": (lambda o: _container(o).pop("image"), "has no image"),
    "listening on loopback": (_set_arg("--host", "127.0.0.1"), "is loopback"),
    "flag serve does not have": (_set_arg("--max-batches", "8"), "No such option"),
    "--port differs from the container port": (_set_arg("--port", "50070"), "--port=50070"),
    "verify burst below the longest draft": (
        _set_arg("--verify-burst", "8"),
        "verify_burst=8 is below the cost of the longest verify",
    ),
    "unknown tracing exporter": (
        lambda o: _container(o)["env"].append({"name": "FEDGE_TRACING", "value": "jaeger"}),
        "TracingConfig.exporter",
    ),
    "mount of an undeclared volume": (
        lambda o: _container(o)["volumeMounts"][0].update(name="model"),
        "mounts volume 'model'",
    ),
    "a secret in the environment": (
        lambda o: _container(o)["env"].append(
            {
                "name": "FEDGE_VERIFIER_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": "t", "key": "t"}},
            }
        ),
        "from a Secret in its environment",
    ),
    "root user allowed": (
        lambda o: o[0]["spec"]["template"]["spec"]["securityContext"].pop("runAsNonRoot"),
        "runAsNonRoot",
    ),
    "termination grace shorter than the drain": (
        lambda o: o[0]["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=10),
        "must exceed the 21 s drain",
    ),
    "Deployment selector does not match its pods": (
        lambda o: o[0]["spec"]["selector"]["matchLabels"].update({"app.kubernetes.io/name": "x"}),
        "does not match template labels",
    ),
}


@pytest.mark.parametrize("name", list(BREAKAGES))
def test_a_broken_manifest_is_refused(name: str) -> None:
    mutate, expected = BREAKAGES[name]
    objects = copy.deepcopy(verifier_shape())
    mutate(objects)
    problems = all_problems(objects)
    assert any(expected in p for p in problems), problems


def test_docs_apply_every_manifest() -> None:
    applied = set(re.findall(r"kubectl apply -f deploy/k8s/(\S+\.yaml)", DOCS.read_text()))
    assert applied == {p.name for p in K8S.glob("*.yaml")}


# ------------------------------------------------------------------- the fleet: RayService
CRD_SCHEMA = K8S / "schema" / "rayservice-v1.json"  # KubeRay's CRD, pruned (see its $comment)
CORE_MARKER = "x-fedge-core-type"  # where the pruned CRD embeds a core Kubernetes type
KUBERAY_HEAD_LABELS = {"ray.io/node-type": "head"}  # KubeRay adds these to the head pod
WRAP: dict[str, Callable[[Obj], Obj]] = {  # an embedded object as a core object of its own
    "io.k8s.api.core.v1.PodTemplateSpec": lambda v: {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "embedded"},
        "template": v,
    },
    "io.k8s.api.core.v1.Service": lambda v: {"apiVersion": "v1", "kind": "Service", **v},
}


def embedded_core(schema: Obj, value: Any, path: str) -> Iterator[tuple[str, str, Obj]]:
    """(path, core type, object) of each Kubernetes object the pruned CRD marks as embedded."""
    if CORE_MARKER in schema:
        yield path, schema[CORE_MARKER], value
    elif isinstance(value, dict):
        for key, sub in value.items():
            if key in schema.get("properties", {}):
                yield from embedded_core(schema["properties"][key], sub, f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            yield from embedded_core(schema["items"], item, f"{path}[{index}]")


def crd_problems(rayservice: Obj) -> list[str]:
    """The RayService against KubeRay's CRD; its pod templates and Services against the core schema."""
    schema = json.loads(CRD_SCHEMA.read_text())
    problems = [
        f"RayService {'.'.join(str(p) for p in error.path)}: {error.message}"
        for error in jsonschema.Draft7Validator(schema).iter_errors(rayservice)
    ]
    for path, core, value in embedded_core(schema, rayservice, ""):
        problems += [f"{path}: {p}" for p in schema_problems(WRAP[core](value))]
    return problems


def _models(annotation: Any) -> list[type[pydantic.BaseModel]]:
    """The pydantic models inside a field's type (list[X], X | None, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _models(arg)]


def unknown_fields(model: type[pydantic.BaseModel], data: Any, path: str) -> list[str]:
    """Keys Ray's Serve schema would silently ignore (it allows extra fields), recursively."""
    if not isinstance(data, dict):
        return []
    fields = model.model_fields
    problems = [
        f"{path}.{key}: no such field in {model.__name__}" for key in data if key not in fields
    ]
    for name, info in fields.items():
        values = data.get(name)
        for sub in _models(info.annotation):
            for value in values if isinstance(values, list) else [values]:
                problems += unknown_fields(sub, value, f"{path}.{name}")
    return problems


def build(application: Obj) -> Any:
    """Run an application's Serve builder (`import_path`) on its args, as Serve would."""
    module, _, attr = application["import_path"].partition(":")
    return getattr(importlib.import_module(module), attr)(application.get("args") or {})


def serve_config_problems(config: Obj) -> list[str]:
    """serveConfigV2: Ray's schema (strict), then each application built from its args."""
    from ray.serve.schema import ServeDeploySchema

    problems = unknown_fields(ServeDeploySchema, config, "serveConfigV2")
    try:
        ServeDeploySchema.model_validate(config)
    except pydantic.ValidationError as err:
        problems.append(f"serveConfigV2: {err}")
    for application in config.get("applications", []):
        try:
            built = build(application)
        except (ImportError, AttributeError, TypeError, ValueError) as err:
            problems.append(f"application {application.get('name')}: {err}")
            continue
        deployment = built._bound_deployment.name  # the application's ingress deployment
        for override in application.get("deployments", []):
            if override["name"] != deployment:
                problems.append(
                    f"application {application['name']} overrides deployment "
                    f"{override['name']!r}; it has {deployment!r}"
                )
    return problems


def fleet_problems(objects: list[Obj]) -> list[str]:
    """The fleet shape: schemas, Serve config, and what ties the ingress, head pod and Service;
    then its Redis (`redis_problems`)."""
    kinds = {o["kind"]: o for o in objects if o["metadata"]["name"] == "fedge-fleet"}
    if "NetworkPolicy" not in kinds:
        return ["no NetworkPolicy: Ray's ports are open to every pod in the cluster"]
    rayservice, service, policy = kinds["RayService"], kinds["Service"], kinds["NetworkPolicy"]
    problems = crd_problems(rayservice) + schema_problems(service) + schema_problems(policy)
    if problems:
        return problems
    cluster = rayservice["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    templates = [head["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    if cluster.get("authOptions", {}).get("mode") != "token":
        problems.append("rayClusterConfig.authOptions.mode must be token (Ray token auth)")
    for template in templates:
        problems += pod_problems(template)
        for container in template["spec"]["containers"]:
            problems += secret_problems(template["spec"], container, {})
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            if env.get("RAY_AUTH_MODE") != "token":
                problems.append(f"{container['name']}: RAY_AUTH_MODE must be token")
    config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    problems += serve_config_problems(config)
    ingress_args = next(
        (a.get("args") or {} for a in config["applications"] if "stable" in (a.get("args") or {})),
        {},
    )
    if not all(ingress_args.get(k) for k in ("credentials_file", "tls_cert", "tls_key")):
        problems.append("the ingress must serve TLS (tls_cert, tls_key) and credentials_file")
    (head_container,) = head["template"]["spec"]["containers"]
    files = {k: ingress_args.get(k) for k in ("credentials_file", "tls_cert", "tls_key")}
    problems += secret_problems(head["template"]["spec"], head_container, files)
    problems += network_policy_problems(policy, templates, int(ingress_args.get("port", 50061)))
    head_template = {
        "metadata": {"labels": {**head["template"]["metadata"]["labels"], **KUBERAY_HEAD_LABELS}},
        "spec": head["template"]["spec"],
    }
    problems += service_problems(service, head_template)
    head_ports = {
        p.get("name"): p["containerPort"]
        for c in head["template"]["spec"]["containers"]
        for p in c.get("ports", [])
    }
    head_resources = json.loads(json.loads(head["rayStartParams"].get("resources", '"{}"')))
    for application in config["applications"]:
        args = application.get("args") or {}
        if "port" in args and args["port"] not in head_ports.values():
            problems.append(f"{application['name']} listens on {args['port']}: no head port")
        if args.get("host") in LOOPBACK:
            problems.append(f"{application['name']} listens on loopback {args['host']}")
        for override in application.get("deployments", []):
            wanted = override.get("ray_actor_options", {}).get("resources", {})
            for resource in set(wanted) - set(head_resources):
                problems.append(
                    f"{application['name']} needs Ray resource {resource!r}: no node has it"
                )
    if config.get("proxy_location") != "Disabled":
        problems.append(
            "serveConfigV2.proxy_location must be Disabled: no application speaks HTTP, and "
            f"Serve's proxy would listen on {config.get('http_options', {}).get('port', 8000)}"
        )
    if cluster.get("rayVersion") != ray.__version__:
        problems.append(f"rayVersion {cluster.get('rayVersion')} is not Ray {ray.__version__}")
    for application in config["applications"]:
        for override in application.get("deployments", []):
            wanted = override.get("ray_actor_options", {}).get("resources", {})
            count = int((application.get("args") or {}).get("replicas", 1))
            for resource, amount in wanted.items():
                if head_resources.get(resource, 0) < amount * count:
                    problems.append(
                        f"{application['name']}'s {count} replicas need {amount * count} "
                        f"{resource!r}; the head offers {head_resources.get(resource, 0)}"
                    )
    return problems + redis_problems(objects, ingress_args, head["template"])


def _bytes(size: str) -> int:
    """A memory size as Redis (768mb) or Kubernetes (1Gi) writes it, in bytes."""
    units = {
        "gi": 1 << 30,
        "mi": 1 << 20,
        "ki": 1 << 10,
        "gb": 1 << 30,
        "mb": 1 << 20,
        "kb": 1 << 10,
    }
    size = size.strip().lower()
    for unit, factor in units.items():
        if size.endswith(unit):
            return int(float(size[: -len(unit)]) * factor)
    return int(size)


def redis_problems(objects: list[Obj], ingress_args: Obj, head: Obj) -> list[str]:
    """The ingress keeps its state in the fedge-redis Service: a Deployment it selects, its
    password a documented Secret's file on both sides, only the fleet's pods admitted."""
    named = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    deployment = named.get(("Deployment", "fedge-redis"))
    service = named.get(("Service", "fedge-redis"))
    policy = named.get(("NetworkPolicy", "fedge-redis"))
    if deployment is None or service is None:
        return ["no Redis Deployment and Service fedge-redis: the ingresses' state has no home"]
    problems = [p for o in (deployment, service, policy) if o for p in schema_problems(o)]
    if problems:
        return problems
    template = deployment["spec"]["template"]
    problems += deployment_problems(deployment) + service_problems(service, template)
    url = urlsplit(str(ingress_args.get("redis_url") or ""))
    if (url.hostname, url.port) != ("fedge-redis", service["spec"]["ports"][0]["port"]):
        problems.append(
            f"the ingress must keep its state in the fedge-redis Service (redis_url), "
            f"got {ingress_args.get('redis_url')!r}"
        )
    (head_container,) = head["spec"]["containers"]
    password = {"redis_password_file": ingress_args.get("redis_password_file")}
    if password["redis_password_file"] is None:
        problems.append("the ingress needs redis_password_file (a Redis without a password)")
    problems += secret_problems(head["spec"], head_container, password)
    containers = template["spec"].get("initContainers", []) + template["spec"]["containers"]
    secrets = {v["secret"]["secretName"] for v in template["spec"]["volumes"] if "secret" in v}
    if not secrets & documented_secrets():
        problems.append("Redis reads no password from a documented Secret's file")
    for container in containers:
        problems += secret_problems(template["spec"], container, {})
        if "requirepass" in " ".join(container.get("args", [])):
            problems.append(f"{container['name']}: the Redis password is in its arguments")
    (redis,) = template["spec"]["containers"]
    args = [str(a) for a in redis.get("args", [])]
    options = dict(zip(args[1::2], args[2::2], strict=False))  # after the config file
    if options.get("--maxmemory-policy") != "noeviction":
        problems.append(
            "Redis must run with --maxmemory-policy noeviction (any other policy may evict a live "
            f"session's home or a device's token bucket), got {options.get('--maxmemory-policy')}"
        )
    limit = redis.get("resources", {}).get("limits", {}).get("memory")
    if (
        "--maxmemory" not in options
        or limit is None
        or (_bytes(options["--maxmemory"]) >= _bytes(limit))
    ):
        problems.append(f"Redis needs --maxmemory below its memory limit {limit}")
    config = " ".join(
        " ".join(map(str, [*c.get("command", []), *c.get("args", [])])) for c in containers
    )
    if "user default off" not in config or "~fedge:fleet:*" not in config:
        problems.append("Redis must turn its default user off and limit the fleet's user's keys")
    if url.username != "fedge":
        problems.append(f"the ingress must log in as ACL user fedge, got {url.username!r}")
    if policy is None:
        return [*problems, "no NetworkPolicy fedge-redis: every pod could read the fleet's state"]
    selected = policy["spec"]["podSelector"].get("matchLabels", {})
    labels = template["metadata"]["labels"]
    if not selected or any(labels.get(k) != v for k, v in selected.items()):
        problems.append(f"NetworkPolicy fedge-redis selects {selected}, not the Redis pod")
    fleet_only = {"fedge.io/fleet": "fedge-fleet"}
    for rule in policy["spec"].get("ingress", []):
        peers = rule.get("from", [])
        if not peers or any(
            p.get("podSelector", {}).get("matchLabels") != fleet_only for p in peers
        ):
            problems.append(f"NetworkPolicy fedge-redis admits {peers or 'everyone'} to Redis")
    return problems


def network_policy_problems(policy: Obj, templates: list[Obj], ingress_port: int) -> list[str]:
    """The policy covers every Ray pod; only fleet pods (and the operator, the dashboard) reach
    Ray's ports; everyone else reaches the ingress port alone."""
    spec = policy["spec"]
    selector = spec["podSelector"].get("matchLabels", {})
    problems = []
    for template in templates:
        labels = template["metadata"].get("labels", {})
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            problems.append(f"NetworkPolicy selector {selector} misses Ray pods labelled {labels}")
    if "Ingress" not in spec.get("policyTypes", []):
        problems.append("NetworkPolicy must restrict Ingress")
    for rule in spec.get("ingress", []):
        peers = rule.get("from", [])
        ports = {p.get("port") for p in rule.get("ports", [])}
        own = peers and all(p.get("podSelector", {}).get("matchLabels") == selector for p in peers)
        if own and "namespaceSelector" not in str(peers):
            continue  # the fleet's own pods: any port
        if not ports:
            problems.append(f"NetworkPolicy rule {rule} admits other peers to every port")
        operator = peers and all("kuberay-operator" in str(p) for p in peers)
        allowed = {ingress_port} | ({8265} if operator else set())
        if ports - allowed:
            problems.append(
                f"NetworkPolicy admits {peers or 'everyone'} to Ray ports {ports - allowed}"
            )
    return problems


def fleet_shape() -> list[Obj]:
    return load("fleet-rayservice.yaml") + load("fleet-redis.yaml")


def test_fleet_manifests_pass_every_check() -> None:
    """Ray token auth, a NetworkPolicy admitting only the fleet to Ray's ports, an ingress on TLS
    with per-device credentials read from Secret files.

    Main's manifest fails it: no NetworkPolicy (any pod could submit a Ray job or call
    `promote`), no Ray token auth, the shared token in every pod's environment (checked)."""
    objects = fleet_shape()
    assert [o["kind"] for o in objects] == [
        *("RayService", "Service", "NetworkPolicy"),
        *("PersistentVolumeClaim", "Deployment", "Service", "NetworkPolicy"),  # its Redis
    ]
    assert fleet_problems(objects) == []


def test_fleet_image_carries_the_clusters_ray() -> None:
    (rayservice, *_) = fleet_shape()
    version = rayservice["spec"]["rayClusterConfig"]["rayVersion"]
    assert f"rayproject/ray:{version}-" in (REPO / "deploy" / "Dockerfile").read_text()


def _cluster(objects: list[Obj]) -> Obj:
    return objects[0]["spec"]["rayClusterConfig"]


def _serve(mutate: Callable[[Obj], object]) -> Callable[[list[Obj]], None]:
    """A breakage of the Serve config inside the RayService."""

    def apply(objects: list[Obj]) -> None:
        config = yaml.safe_load(objects[0]["spec"]["serveConfigV2"])
        mutate(config)
        objects[0]["spec"]["serveConfigV2"] = yaml.safe_dump(config)

    return apply


def _head(objects: list[Obj]) -> Obj:
    return _cluster(objects)["headGroupSpec"]["template"]["spec"]["containers"][0]


def _worker(objects: list[Obj]) -> Obj:
    return _cluster(objects)["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]


FLEET_BREAKAGES: dict[str, tuple[Callable[[list[Obj]], None], str]] = {
    "misspelt RayService field": (
        lambda o: _cluster(o)["headGroupSpec"].update(
            rayStartParam=_cluster(o)["headGroupSpec"].pop("rayStartParams")
        ),
        "'rayStartParam' was unexpected",
    ),
    "worker group without maxReplicas": (
        lambda o: _cluster(o)["workerGroupSpecs"][0].pop("maxReplicas"),
        "'maxReplicas' is a required property",
    ),
    "misspelt field in an embedded pod template": (
        lambda o: _head(o).update(imagePulPolicy=_head(o).pop("imagePullPolicy")),
        "'imagePulPolicy' was unexpected",
    ),
    "worker may run as root": (
        lambda o: _cluster(o)["workerGroupSpecs"][0]["template"]["spec"]["securityContext"].pop(
            "runAsNonRoot"
        ),
        "runAsNonRoot",
    ),
    "misspelt Serve config field": (
        _serve(lambda c: c["applications"][0].update(import_paths="x")),
        "import_paths: no such field",
    ),
    "import path that does not resolve": (
        _serve(
            lambda c: c["applications"][0].update(
                import_path="fedge.edge.fleet.kuberay:replica_app"
            )
        ),
        "replica_app",
    ),
    "builder arg it does not know": (
        _serve(lambda c: c["applications"][0]["args"].update(replica=3)),
        "unknown args ['replica']",
    ),
    "unknown load-balancing policy": (
        _serve(lambda c: c["applications"][0]["args"].update(policy="random")),
        "unknown load-balancing policy 'random'",
    ),
    "override of a deployment the application lacks": (
        _serve(lambda c: c["applications"][1]["deployments"][0].update(name="ingres")),
        "overrides deployment 'ingres'",
    ),
    "ingress on a port the head does not expose": (
        _serve(lambda c: c["applications"][1]["args"].update(port=50062)),
        "listens on 50062: no head port",
    ),
    "ingress on loopback": (
        _serve(lambda c: c["applications"][1]["args"].update(host="127.0.0.1")),
        "listens on loopback",
    ),
    "ingress pinned to a resource no node has": (
        lambda o: _cluster(o)["headGroupSpec"]["rayStartParams"].update(resources='"{}"'),
        "needs Ray resource 'fedge_ingress'",
    ),
    "Service targets a port the head lacks": (
        lambda o: o[1]["spec"]["ports"][0].update(targetPort="grpc"),
        "targets 'grpc': no such pod port",
    ),
    "Service selects worker pods": (
        lambda o: o[1]["spec"]["selector"].update({"ray.io/node-type": "worker"}),
        "does not select pods",
    ),
    "rayVersion other than the installed Ray": (
        lambda o: _cluster(o).update(rayVersion="2.9.0"),
        "rayVersion 2.9.0",
    ),
    "a secret in a worker's environment": (
        lambda o: _worker(o)["env"].append(
            {
                "name": "FEDGE_VERIFIER_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": "t", "key": "t"}},
            }
        ),
        "from a Secret in its environment",
    ),
    "Ray without token authentication": (
        lambda o: _cluster(o).pop("authOptions"),
        "authOptions.mode must be token",
    ),
    "a Ray container without RAY_AUTH_MODE": (
        lambda o: _worker(o).update(
            env=[e for e in _worker(o)["env"] if e["name"] != "RAY_AUTH_MODE"]
        ),
        "ray-worker: RAY_AUTH_MODE must be token",
    ),
    "no NetworkPolicy": (lambda o: o.pop(2), "no NetworkPolicy"),
    "Ray's GCS open to everyone": (
        lambda o: o[2]["spec"]["ingress"][2]["ports"].append({"port": 6379, "protocol": "TCP"}),
        "to Ray ports {6379}",
    ),
    "NetworkPolicy missing the worker pods": (
        lambda o: _cluster(o)["workerGroupSpecs"][0]["template"]["metadata"]["labels"].pop(
            "fedge.io/fleet"
        ),
        "misses Ray pods",
    ),
    "ingress without TLS": (
        _serve(lambda c: [c["applications"][1]["args"].pop(k) for k in ("tls_cert", "tls_key")]),
        "the ingress must serve TLS",
    ),
    "no Redis for the ingresses' state": (
        lambda o: o.pop(4),
        "no Redis Deployment and Service fedge-redis",
    ),
    "ingress without redis_url": (
        _serve(lambda c: c["applications"][1]["args"].pop("redis_url")),
        "must keep its state in the fedge-redis Service",
    ),
    "ingress keeping its state in another Redis": (
        _serve(lambda c: c["applications"][1]["args"].update(redis_url="redis://cache:6379/0")),
        "must keep its state in the fedge-redis Service",
    ),
    "Redis password in the URL": (
        _serve(
            lambda c: c["applications"][1]["args"].update(redis_url="redis://:pw@fedge-redis:6379")
        ),
        "carries a password",
    ),
    "Redis password file outside a Secret volume": (
        _serve(lambda c: c["applications"][1]["args"].update(redis_password_file="/models/pw")),
        "redis_password_file /models/pw is not in a volume of a Secret",
    ),
    "Redis password in its arguments": (
        lambda o: o[4]["spec"]["template"]["spec"]["containers"][0]["args"].extend(
            ["--requirepass", "pw"]
        ),
        "the Redis password is in its arguments",
    ),
    "Redis open to every pod": (
        lambda o: o[6]["spec"]["ingress"][0].pop("from"),
        "NetworkPolicy fedge-redis admits everyone",
    ),
    "no NetworkPolicy for Redis": (
        lambda o: o.pop(6),
        "no NetworkPolicy fedge-redis",
    ),
    "Serve's HTTP proxy on": (
        _serve(lambda c: c.update(proxy_location="HeadOnly")),
        "proxy_location must be Disabled",
    ),
    "Redis may evict live sessions": (
        lambda o: o[4]["spec"]["template"]["spec"]["containers"][0]["args"].__setitem__(
            -1, "allkeys-lru"
        ),
        "--maxmemory-policy noeviction",
    ),
    "Redis without maxmemory": (
        lambda o: o[4]["spec"]["template"]["spec"]["containers"][0]["args"].__setitem__(-3, "2gb"),
        "--maxmemory below its memory limit",
    ),
    "Redis's default user on": (
        lambda o: o[4]["spec"]["template"]["spec"]["initContainers"][0]["command"].__setitem__(
            -1, "printf 'requirepass x' > /conf/redis.conf"
        ),
        "default user off",
    ),
    "two ingress replicas, room for one on the head": (
        lambda o: _cluster(o)["headGroupSpec"]["rayStartParams"].update(
            resources='"{\\"fedge_ingress\\": 1}"'
        ),
        "2 replicas need 2 'fedge_ingress'; the head offers 1",
    ),
    "ingress credentials outside a Secret volume": (
        _serve(lambda c: c["applications"][1]["args"].update(credentials_file="/models/devices")),
        "credentials_file /models/devices is not in a volume of a Secret",
    ),
}


@pytest.mark.parametrize("name", list(FLEET_BREAKAGES))
def test_a_broken_fleet_manifest_is_refused(name: str) -> None:
    mutate, expected = FLEET_BREAKAGES[name]
    objects = copy.deepcopy(fleet_shape())
    mutate(objects)
    problems = fleet_problems(objects)
    assert any(expected in p for p in problems), problems
