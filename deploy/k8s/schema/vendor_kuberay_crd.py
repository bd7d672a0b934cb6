"""Shrink KubeRay's RayService CRD to the fields fedge checks its manifest against.

The CRD (`ray-operator/config/crd/bases/ray.io_rayservices.yaml` of a KubeRay
release) is about 1 MB because it inlines the Kubernetes pod and Service
schemas. Those subtrees are replaced by a marker naming the core type, and the
tests validate them with the official Kubernetes schema instead; descriptions
and `status` are dropped. Every object that lists its properties gets
`additionalProperties: false`, which is what `kubectl apply --validate=strict`
does with unknown fields.

    python deploy/k8s/schema/vendor_kuberay_crd.py ray.io_rayservices.yaml v1.7.0 \
        > deploy/k8s/schema/rayservice-v1.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml

# CRD property name -> the core Kubernetes type it embeds (checked with the core schema).
CORE_TYPES = {
    "template": "io.k8s.api.core.v1.PodTemplateSpec",
    "headService": "io.k8s.api.core.v1.Service",
    "serveService": "io.k8s.api.core.v1.Service",
}
CORE_MARKER = "x-fedge-core-type"


def prune(node: Any) -> Any:
    """Drop descriptions, replace embedded core types by markers, forbid unknown fields."""
    if isinstance(node, list):
        return [prune(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "description":
            continue
        if key == "properties":
            out[key] = {
                name: {"type": "object", CORE_MARKER: CORE_TYPES[name]}
                if name in CORE_TYPES
                else prune(sub)
                for name, sub in value.items()
            }
        else:
            out[key] = prune(value)
    if "properties" in out and out.get("type") == "object":
        out["additionalProperties"] = False
    return out


def main(crd_path: str, release: str) -> None:
    """Print the pruned openAPIV3Schema of the CRD's v1 version as JSON."""
    with open(crd_path) as file:
        crd = yaml.safe_load(file)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = version["schema"]["openAPIV3Schema"]
    schema["properties"].pop("status", None)
    pruned = prune(schema)
    pruned["properties"]["metadata"] = {"type": "object"}
    pruned["$comment"] = (
        f"KubeRay {release} RayService v1 CRD, pruned by deploy/k8s/schema/vendor_kuberay_crd.py"
    )
    json.dump(pruned, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: vendor_kuberay_crd.py RAYSERVICES_CRD.yaml RELEASE_TAG")
    main(sys.argv[1], sys.argv[2])
