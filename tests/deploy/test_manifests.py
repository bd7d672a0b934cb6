"""The Kubernetes manifests in deploy/k8s: official schemas (strict) plus the cross-references a schema cannot see.

No cluster runs here. Each object is checked against the Kubernetes JSON schema
(kubernetes-validate, strict: unknown fields are errors) at the oldest and the
newest Kubernetes version we claim; then against what a schema cannot know:
probe ports that name no container port, Service target ports and selectors that
match no pod, mounts of undeclared volumes, a listen address a pod cannot be
reached on, arguments `fedge verifier serve` would reject, a Secret other than
the one docs/fleet.md tells you to create, a secret in an environment variable
rather than a mounted file, a listener without TLS or per-device credentials, Ray
without token authentication, Ray's ports open beyond the fleet's own pods. Then the
network's identities (`peer_problems`, `egress_problems`): a NetworkPolicy peer must be
something a pod cannot assert, a namespace by the name the API server sets or a label
the admission policy of fedge-admission.yaml refuses to a stranger's pod (its CEL rules
run here, on pods, with cel-python); every pod's egress is denied but for what it needs;
Redis speaks TLS only; the verifier's metrics have their own port, Service and peer.
Every check has a test that breaks the manifest on purpose and expects the check to
name the fault.
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
from urllib.parse import parse_qsl, urlsplit

import click
import jsonschema
import kubernetes_validate
import pydantic
import pytest
import ray
import typer
import yaml
from celpy import Environment, celtypes, json_to_cel

from fedge.edge.cli import verifier_app
from fedge.edge.proto import verifier_pb2
from fedge.edge.verifier.server import ServerConfig

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
DOCS = REPO / "docs" / "fleet.md"
# ValidatingAdmissionPolicy (fedge-admission.yaml) is v1 from 1.30; 1.37 is the newest schema shipped
K8S_VERSIONS = ("1.30", "1.37")
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
HEALTH_SERVICES = ("", SERVICE_NAME)  # what the verifier's grpc.health.v1 servicer reports
NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # the API server sets it: no namespace picks it
STRANGER = "system:serviceaccount:fedge:intruder"  # anyone allowed to create pods somewhere
ADMISSION = "fedge-admission.yaml"
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
    return problems + verifier_network_problems(objects, deployment)


def verifier_shape() -> list[Obj]:
    return load("verifier.yaml") + load("models-pvc.yaml")


def named(objects: list[Obj], kind: str, name: str) -> Obj:
    """The object of `kind` called `name` (KeyError naming both when absent)."""
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise KeyError(f"no {kind} {name}")


# ----------------------------------------------------------- network identity and egress
class Admission:
    """The ValidatingAdmissionPolicies of a manifest set, run on a pod as the API server would:
    each policy's `variables`, then its `validations` (CEL, by cel-python), for the policies a
    Deny binding enforces. Only pod CREATE/UPDATE rules are modelled (all fedge-admission has)."""

    def __init__(self, objects: list[Obj]) -> None:
        bound = {
            o["spec"]["policyName"]
            for o in objects
            if o["kind"] == "ValidatingAdmissionPolicyBinding"
            and "Deny" in o["spec"].get("validationActions", [])
        }
        self.policies = [
            o["spec"]
            for o in objects
            if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"] in bound
        ]
        self._env = Environment()
        # a stranger may name any service account of the namespace in its pod
        self.accounts = ["default"] + [
            o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"
        ]

    def _run(self, expression: str, activation: dict[str, Any]) -> Any:
        return self._env.program(self._env.compile(expression)).evaluate(activation)

    def refusals(
        self, pod: Obj, username: str, operation: str = "CREATE", old: Obj | None = None
    ) -> list[str]:
        """The messages of the validations that refuse `pod` (empty: admitted)."""
        messages = []
        for spec in self.policies:
            rules = spec.get("matchConstraints", {}).get("resourceRules", [])
            if not any("pods" in r["resources"] and operation in r["operations"] for r in rules):
                continue
            request = {"operation": operation, "userInfo": {"username": username}}
            activation: dict[str, Any] = {
                "object": json_to_cel(pod),
                "oldObject": json_to_cel(old or {}),
                "request": json_to_cel(request),
            }
            variables: dict[Any, Any] = {}
            for variable in spec.get("variables", []):
                activation["variables"] = celtypes.MapType(variables)
                value = self._run(variable["expression"], activation)
                variables[celtypes.StringType(variable["name"])] = value
            activation["variables"] = celtypes.MapType(variables)
            for rule in spec.get("validations", []):
                verdict = self._run(rule["expression"], activation)
                if not (isinstance(verdict, celtypes.BoolType) and bool(verdict)):  # or an error
                    messages.append(str(rule.get("message", rule["expression"])))
        return messages

    def binds(self, labels: dict[str, str]) -> bool:
        """Whether a stranger, running its pod under any service account it may name, can
        neither create a pod carrying `labels` nor add them to a pod of its own."""
        for account in self.accounts:
            spec = {"serviceAccountName": account, "containers": []}
            pod = {"metadata": {"name": "x", "labels": dict(labels)}, "spec": spec}
            bare = {"metadata": {"name": "x", "labels": {}}, "spec": spec}
            if not self.refusals(pod, STRANGER) or not self.refusals(pod, STRANGER, "UPDATE", bare):
                return False
        return True


def _pod(template: Obj) -> Obj:
    """The pod a template makes (what admission sees)."""
    return {"metadata": copy.deepcopy(template["metadata"]), "spec": template["spec"]}


def peer_problems(
    policy: Obj, admission: Admission, authenticated: frozenset[str] = frozenset()
) -> list[str]:
    """Each peer of a NetworkPolicy names an identity a pod cannot assert: a namespace by
    `kubernetes.io/metadata.name` (set by the API server), or, in the policy's namespace,
    pod labels the admission policy refuses to a stranger's pod. An egress destination whose
    traffic authenticates the server (`authenticated`: app names, e.g. Redis over TLS with its
    certificate checked) may be named by its app label: a pod standing in for it learns nothing."""
    name = policy["metadata"]["name"]
    problems = []
    spec = policy["spec"]
    peers = [p for r in spec.get("ingress", []) for p in r.get("from", [])]
    for peer in (p for r in spec.get("egress", []) for p in r.get("to", [])):
        app = peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name")
        if app not in authenticated or "namespaceSelector" in peer:
            peers.append(peer)
    for peer in peers:
        if "ipBlock" in peer:
            problems.append(f"NetworkPolicy {name} peer {peer}: an address, not an identity")
            continue
        if "namespaceSelector" in peer:
            namespaces = peer["namespaceSelector"]
            if set(namespaces) != {"matchLabels"} or set(namespaces["matchLabels"]) != {
                NAMESPACE_LABEL
            }:
                problems.append(
                    f"NetworkPolicy {name} namespaceSelector {namespaces} must name one namespace "
                    f"by {NAMESPACE_LABEL} (any other namespace label is the namespace's to set)"
                )
            continue
        labels = peer.get("podSelector", {}).get("matchLabels", {})
        if set(peer.get("podSelector", {})) - {"matchLabels"} or not admission.binds(labels):
            problems.append(
                f"NetworkPolicy {name} trusts pods labelled {labels}: a label any pod in the "
                f"namespace may carry (no admission policy binds it to an identity)"
            )
    return problems


def egress_problems(policy: Obj, ports: dict[str, set[int]]) -> list[str]:
    """The policy restricts egress and each rule opens a named peer's ports: DNS (port 53 in
    kube-system), a peer of ours (`ports` by its app name: those ports; the fleet's own pods:
    any), or, with no peer, the API server's ports from the Ray head alone (its autoscaler)."""
    name = policy["metadata"]["name"]
    spec = policy["spec"]
    if "Egress" not in spec.get("policyTypes", []):
        return [f"NetworkPolicy {name} must restrict Egress (default deny, then what it needs)"]
    problems = []
    for rule in spec.get("egress", []):
        opened = {p.get("port") for p in rule.get("ports", [])}
        peers = rule.get("to", [])
        head_only = spec["podSelector"].get("matchLabels", {}).get("ray.io/node-type") == "head"
        if not peers:
            if not (head_only and opened and opened <= {443, 6443}):
                problems.append(
                    f"NetworkPolicy {name} opens egress to anywhere on {opened or 'all ports'}"
                )
            continue
        for peer in peers:
            namespace = (
                peer.get("namespaceSelector", {}).get("matchLabels", {}).get(NAMESPACE_LABEL)
            )
            app = peer.get("podSelector", {}).get("matchLabels", {})
            if namespace is not None:
                if namespace != "kube-system" or not opened or opened != {53}:
                    problems.append(
                        f"NetworkPolicy {name} opens egress to namespace {namespace} on "
                        f"{opened or 'all ports'}: only DNS (53 in kube-system) leaves the fleet"
                    )
            elif app.get("app.kubernetes.io/name") in ports:
                wanted = ports[app["app.kubernetes.io/name"]]
                if not opened or not opened <= wanted:
                    problems.append(
                        f"NetworkPolicy {name} opens {app} on {opened or 'all ports'}, "
                        f"not its ports {wanted}"
                    )
            elif "fedge.io/fleet" not in app:
                problems.append(f"NetworkPolicy {name} opens egress to {peer}")
    return problems


def policies_for(objects: list[Obj], labels: dict[str, str]) -> list[Obj]:
    """The NetworkPolicies that select pods labelled `labels`."""
    return [
        o
        for o in objects
        if o["kind"] == "NetworkPolicy"
        and all(
            labels.get(k) == v for k, v in o["spec"]["podSelector"].get("matchLabels", {}).items()
        )
    ]


def verifier_network_problems(objects: list[Obj], deployment: Obj) -> list[str]:
    """A NetworkPolicy selects the verifier: everyone reaches the gRPC port alone, the metrics
    port only Prometheus's namespace, egress only DNS; the devices' Service carries no metrics."""
    template = deployment["spec"]["template"]
    labels = template["metadata"]["labels"]
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    policies = policies_for(objects, labels)
    problems = []
    if not policies:
        problems.append(
            "no NetworkPolicy selects the verifier: every pod reaches its metrics and ports"
        )
    for policy in policies:
        problems += peer_problems(policy, Admission(objects)) + egress_problems(policy, {})
        if "Ingress" not in policy["spec"].get("policyTypes", []):
            problems.append(f"NetworkPolicy {policy['metadata']['name']} must restrict Ingress")
        for rule in policy["spec"].get("ingress", []):
            opened = {p.get("port") for p in rule.get("ports", [])}
            if not opened:
                problems.append(f"NetworkPolicy rule {rule} admits peers to every verifier port")
            if not rule.get("from") and opened - {ports["grpc"]}:
                problems.append(
                    f"the verifier's ports {opened - {ports['grpc']}} are open to everyone"
                )
            if ports["metrics"] in opened and not all(
                "namespaceSelector" in p for p in rule.get("from", [{}])
            ):
                problems.append("the verifier's metrics port is open beyond Prometheus's namespace")
    devices = named(objects, "Service", "fedge-verifier")
    exposed = {str(p.get("targetPort", p["port"])) for p in devices["spec"]["ports"]}
    if exposed & {"metrics", str(ports["metrics"])}:
        problems.append("the devices' Service fedge-verifier exposes the metrics port")
    if ports["metrics"] in (ports["grpc"], ports.get("health")):
        problems.append("metrics must have their own port")
    return problems


# ---------------------------------------------------------------------------------- tests
def test_verifier_manifests_pass_every_check() -> None:
    """TLS, per-device credentials and every secret as a mounted file, probes on the health port.

    Main's manifest fails it: a plaintext listener, one shared token in the environment, probes
    on the gRPC port (checked: four problems named). Before issue 31's manifests it failed
    too: no NetworkPolicy (every pod reached the metrics, whose KV-bytes gauge sized the
    starvation attack) and the metrics port in the devices' Service (two problems named)."""
    objects = verifier_shape()
    assert [o["kind"] for o in objects] == [
        *("Deployment", "Service", "Service", "NetworkPolicy", "PersistentVolumeClaim")
    ]
    assert all_problems(objects) == []


def test_model_volume_is_the_documented_claim() -> None:
    objects = verifier_shape()
    deployment, claim = objects[0], named(objects, "PersistentVolumeClaim", "fedge-models")
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
    "no NetworkPolicy for the verifier": (
        lambda o: o.remove(named(o, "NetworkPolicy", "fedge-verifier")),
        "no NetworkPolicy selects the verifier",
    ),
    "metrics open to everyone": (
        lambda o: named(o, "NetworkPolicy", "fedge-verifier")["spec"]["ingress"][0]["ports"].append(
            {"port": 9090, "protocol": "TCP"}
        ),
        "ports {9090} are open to everyone",
    ),
    "metrics in the devices' Service": (
        lambda o: o[1]["spec"]["ports"].append(
            {"name": "metrics", "port": 9090, "targetPort": "metrics"}
        ),
        "exposes the metrics port",
    ),
    "metrics admitted from a namespace by a label it sets": (
        lambda o: named(o, "NetworkPolicy", "fedge-verifier")["spec"]["ingress"][1]["from"][
            0
        ].update(namespaceSelector={"matchLabels": {"team": "monitoring"}}),
        "must name one namespace by kubernetes.io/metadata.name",
    ),
    "verifier egress open": (
        lambda o: named(o, "NetworkPolicy", "fedge-verifier")["spec"]["egress"].append({}),
        "opens egress to anywhere",
    ),
    "verifier egress not restricted": (
        lambda o: named(o, "NetworkPolicy", "fedge-verifier")["spec"].update(
            policyTypes=["Ingress"]
        ),
        "must restrict Egress",
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
    others = [o for o in objects if o["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    others += [o for o in objects if "ValidatingAdmissionPolicy" in o["kind"]]
    others += [  # fedge-redis's policy: redis_problems checks it
        o
        for o in objects
        if o["kind"] == "NetworkPolicy"
        and o is not policy
        and o["metadata"]["name"] != "fedge-redis"
    ]
    problems += [p for o in others for p in schema_problems(o)]
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
    problems += fleet_identity_problems(objects, templates)
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
    problems += redis_tls_problems(url, template, head)
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


def redis_tls_problems(url: Any, template: Obj, head: Obj) -> list[str]:
    """Redis listens on TLS alone, its key and certificate from a documented Secret's files,
    and the ingress dials rediss:// checking the certificate against a CA from such a file."""
    problems = []
    (redis,) = template["spec"]["containers"]
    args = [str(a) for a in redis.get("args", [])]
    options = dict(zip(args[1::2], args[2::2], strict=False))
    port = next(p["containerPort"] for p in redis["ports"] if p.get("name") == "redis")
    if options.get("--port") != "0" or options.get("--tls-port") != str(port):
        problems.append(
            f"Redis must listen on TLS alone (--port 0, --tls-port {port}): its password and the "
            f"fleet's state would cross the network in clear"
        )
    files = {f: options.get(f) for f in ("--tls-cert-file", "--tls-key-file")}
    if None in files.values():
        problems.append("Redis needs --tls-cert-file and --tls-key-file")
    problems += secret_problems(template["spec"], redis, files)
    query = dict(parse_qsl(url.query))
    if url.scheme != "rediss" or "ssl_ca_certs" not in query:
        problems.append(
            "the ingress must dial Redis over TLS checking its certificate "
            f"(rediss://...?ssl_ca_certs=FILE), got {url.geturl()!r}"
        )
    (head_container,) = head["spec"]["containers"]
    problems += secret_problems(
        head["spec"], head_container, {"ssl_ca_certs": query.get("ssl_ca_certs")}
    )
    return problems


def fleet_identity_problems(objects: list[Obj], templates: list[Obj]) -> list[str]:
    """Every NetworkPolicy of the fleet and its Redis names identities a pod cannot assert and
    restricts egress to what the fleet needs; the admission policy lets the KubeRay operator
    (as the policies name it) create the fleet's pods and the ReplicaSet controller Redis's."""
    admission = Admission(objects)
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    redis = deployments[0]["spec"]["template"] if deployments else None  # none: redis_problems
    redis_ports = (
        {p["containerPort"] for c in redis["spec"]["containers"] for p in c["ports"]}
        if redis
        else set()
    )
    problems = []
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        problems += peer_problems(policy, admission, frozenset({"fedge-redis"}))  # TLS checked
        problems += egress_problems(policy, {"fedge-redis": redis_ports})
    policy = named(objects, "NetworkPolicy", "fedge-fleet")
    operator = [
        p
        for r in policy["spec"].get("ingress", [])
        for p in r.get("from", [])
        if "kuberay-operator" in str(p)
    ]
    namespace = operator[0].get("namespaceSelector", {}).get("matchLabels", {}) if operator else {}
    creator = f"system:serviceaccount:{namespace.get(NAMESPACE_LABEL)}:kuberay-operator"
    for template in templates:
        refused = admission.refusals(_pod(template), creator)
        if refused:
            problems.append(f"the admission policy refuses the fleet's pods ({creator}): {refused}")
    controller = "system:serviceaccount:kube-system:replicaset-controller"
    refused = admission.refusals(_pod(redis), controller) if redis else []
    if refused:
        problems.append(f"the admission policy refuses Redis's pods: {refused}")
    egress = [r for r in policy["spec"].get("egress", []) for p in r.get("to", [])]
    reached = json.dumps(egress)
    for needed in ("fedge-fleet", "fedge-redis", "kube-dns"):
        if needed not in reached:
            problems.append(f"the fleet's egress misses {needed}: the fleet would not work")
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
    return load("fleet-rayservice.yaml") + load("fleet-redis.yaml") + load(ADMISSION)


def test_fleet_manifests_pass_every_check() -> None:
    """Ray token auth, a NetworkPolicy admitting only the fleet to Ray's ports, an ingress on TLS
    with per-device credentials read from Secret files.

    Main's manifest fails it: no NetworkPolicy (any pod could submit a Ray job or call
    `promote`), no Ray token auth, the shared token in every pod's environment (checked).
    Before issue 31's manifests it failed too (checked: 11 problems): the policies trusted
    `fedge.io/fleet`, a label any pod of the namespace could carry (it then reached Ray's GCS,
    the dashboard's job submission and Redis), admitted the operator's label from every
    namespace, denied no egress, and Redis spoke plaintext."""
    objects = fleet_shape()
    assert [o["kind"] for o in objects] == [
        *("RayService", "Service", "ServiceAccount", "Role", "RoleBinding"),
        *("NetworkPolicy", "NetworkPolicy"),
        *("ServiceAccount", "PersistentVolumeClaim", "Deployment", "Service", "NetworkPolicy"),
        *("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"),
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


def _policy(objects: list[Obj]) -> Obj:
    return named(objects, "NetworkPolicy", "fedge-fleet")


def _redis(objects: list[Obj]) -> Obj:
    return named(objects, "Deployment", "fedge-redis")


def _redis_arg(flag: str, value: str | None) -> Callable[[list[Obj]], None]:
    """Set (None: drop) one of Redis's `--flag value` arguments."""

    def mutate(objects: list[Obj]) -> None:
        args = _redis(objects)["spec"]["template"]["spec"]["containers"][0]["args"]
        at = args.index(flag)
        if value is None:
            del args[at : at + 2]
        else:
            args[at + 1] = value

    return mutate


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
    "no NetworkPolicy": (lambda o: o.remove(_policy(o)), "no NetworkPolicy"),
    "Ray's GCS open to everyone": (
        lambda o: _policy(o)["spec"]["ingress"][2]["ports"].append(
            {"port": 6379, "protocol": "TCP"}
        ),
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
        lambda o: o.remove(_redis(o)),
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
        lambda o: _redis(o)["spec"]["template"]["spec"]["containers"][0]["args"].extend(
            ["--requirepass", "pw"]
        ),
        "the Redis password is in its arguments",
    ),
    "Redis open to every pod": (
        lambda o: named(o, "NetworkPolicy", "fedge-redis")["spec"]["ingress"][0].pop("from"),
        "NetworkPolicy fedge-redis admits everyone",
    ),
    "no NetworkPolicy for Redis": (
        lambda o: o.remove(named(o, "NetworkPolicy", "fedge-redis")),
        "no NetworkPolicy fedge-redis",
    ),
    "Serve's HTTP proxy on": (
        _serve(lambda c: c.update(proxy_location="HeadOnly")),
        "proxy_location must be Disabled",
    ),
    "Redis may evict live sessions": (
        lambda o: _redis(o)["spec"]["template"]["spec"]["containers"][0]["args"].__setitem__(
            -1, "allkeys-lru"
        ),
        "--maxmemory-policy noeviction",
    ),
    "Redis without maxmemory": (
        lambda o: _redis(o)["spec"]["template"]["spec"]["containers"][0]["args"].__setitem__(
            -3, "2gb"
        ),
        "--maxmemory below its memory limit",
    ),
    "Redis's default user on": (
        lambda o: _redis(o)["spec"]["template"]["spec"]["initContainers"][0]["command"].__setitem__(
            -1, "printf 'requirepass x' > /conf/redis.conf"
        ),
        "default user off",
    ),
    "misspelt field in the admission binding": (
        lambda o: named(o, "ValidatingAdmissionPolicyBinding", "fedge-identity-labels")[
            "spec"
        ].update(validationAction=["Deny"]),
        "'validationAction' was unexpected",
    ),
    "misspelt field in Redis's service account": (
        lambda o: named(o, "ServiceAccount", "fedge-redis").update(
            automountServiceAccountTokens=False
        ),
        "'automountServiceAccountTokens' was unexpected",
    ),
    "the fleet's label free for any pod": (
        lambda o: o.remove(named(o, "ValidatingAdmissionPolicyBinding", "fedge-identity-labels")),
        "trusts pods labelled {'fedge.io/fleet': 'fedge-fleet'}: a label any pod",
    ),
    "the admission policy checks the account but not the creator": (
        lambda o: named(o, "ValidatingAdmissionPolicy", "fedge-identity-labels")["spec"][
            "validations"
        ].pop(1),
        "trusts pods labelled {'fedge.io/fleet': 'fedge-fleet'}",
    ),
    "a label may be added to a running pod": (
        lambda o: named(o, "ValidatingAdmissionPolicy", "fedge-identity-labels")["spec"][
            "validations"
        ].pop(3),
        "trusts pods labelled",
    ),
    "a peer by an unbound label": (
        lambda o: _policy(o)["spec"]["ingress"][0]["from"][0]["podSelector"].update(
            matchLabels={"app.kubernetes.io/part-of": "fedge"}
        ),
        "trusts pods labelled {'app.kubernetes.io/part-of': 'fedge'}",
    ),
    "the operator admitted from every namespace": (
        lambda o: _policy(o)["spec"]["ingress"][1]["from"][0].update(namespaceSelector={}),
        "namespaceSelector {} must name one namespace",
    ),
    "the operator in another namespace than the admission policy names": (
        lambda o: _policy(o)["spec"]["ingress"][1]["from"][0].update(
            namespaceSelector={"matchLabels": {NAMESPACE_LABEL: "ray-system"}}
        ),
        "refuses the fleet's pods (system:serviceaccount:ray-system:kuberay-operator)",
    ),
    "a fleet pod under the default account": (
        lambda o: _cluster(o)["workerGroupSpecs"][0]["template"]["spec"].pop("serviceAccountName"),
        "must run as service account fedge-fleet",
    ),
    "no egress policy for the fleet": (
        lambda o: _policy(o)["spec"].update(policyTypes=["Ingress"]),
        "NetworkPolicy fedge-fleet must restrict Egress",
    ),
    "fleet egress to anywhere": (
        lambda o: _policy(o)["spec"]["egress"].append({"ports": [{"port": 443}]}),
        "fedge-fleet opens egress to anywhere",
    ),
    "workers may reach the API server": (
        lambda o: named(o, "NetworkPolicy", "fedge-fleet-apiserver")["spec"]["podSelector"][
            "matchLabels"
        ].pop("ray.io/node-type"),
        "fedge-fleet-apiserver opens egress to anywhere",
    ),
    "fleet egress to Redis on every port": (
        lambda o: _policy(o)["spec"]["egress"][1].pop("ports"),
        "on all ports, not its ports {6379}",
    ),
    "fleet egress to another namespace": (
        lambda o: _policy(o)["spec"]["egress"][2]["ports"].append({"port": 443, "protocol": "TCP"}),
        "only DNS (53 in kube-system)",
    ),
    "fleet egress without DNS": (
        lambda o: _policy(o)["spec"]["egress"].pop(2),
        "egress misses kube-dns",
    ),
    "Redis egress open": (
        lambda o: named(o, "NetworkPolicy", "fedge-redis")["spec"].update(egress=[{}]),
        "fedge-redis opens egress to anywhere",
    ),
    "Redis egress not restricted": (
        lambda o: named(o, "NetworkPolicy", "fedge-redis")["spec"].update(policyTypes=["Ingress"]),
        "NetworkPolicy fedge-redis must restrict Egress",
    ),
    "Redis's plaintext port on": (
        _redis_arg("--port", "6380"),
        "Redis must listen on TLS alone",
    ),
    "Redis TLS key outside a Secret volume": (
        _redis_arg("--tls-key-file", "/data/tls.key"),
        "--tls-key-file /data/tls.key is not in a volume of a Secret",
    ),
    "ingress dialing Redis in plaintext": (
        _serve(
            lambda c: c["applications"][1]["args"].update(
                redis_url="redis://fedge@fedge-redis:6379/0"
            )
        ),
        "must dial Redis over TLS",
    ),
    "ingress not checking Redis's certificate": (
        _serve(
            lambda c: c["applications"][1]["args"].update(
                redis_url="rediss://fedge@fedge-redis:6379/0"
            )
        ),
        "must dial Redis over TLS checking its certificate",
    ),
    "ingress turning Redis's certificate check off": (
        _serve(
            lambda c: c["applications"][1]["args"].update(
                redis_url=c["applications"][1]["args"]["redis_url"] + "&ssl_cert_reqs=none"
            )
        ),
        "turns off the check of Redis's TLS certificate",
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
