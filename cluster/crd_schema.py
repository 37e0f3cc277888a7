"""The part of KubeRay's RayService schema that the project's manifests use, kept in the repository.

The suite checks the manifests against this file, so it needs nothing outside the checkout; where
KubeRay's own CRDs are at hand (`KUBERAY_CRDS_DIR`, or `../shared/kuberay-crds` beside the checkout)
it checks them against the full schema too, and that this file is what the CRDs give today.

The file holds facts, not prose: for every field a manifest sets (after the API server's defaults),
or a check reads (`READ_BY_CHECKS`), its type, format, pattern, enum, bounds, default, `required`
list and int-or-string / preserve-unknown markers; descriptions and CEL rules are dropped. Fields
the project never uses are left out, so a strict check against it refuses them: a manifest that
starts using one regenerates this file (`python -m cluster.crd_schema`).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
USED_SCHEMA = ROOT / "k8s" / "schema" / "rayservice.v1.used.json"
CRD_FILE = "ray.io_rayservices.yaml"
KUBERAY_VERSION = "v1.7.0"  # the CRDs the file was cut from
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

KEPT = {"type", "format", "enum", "pattern", "required", "nullable", "default", "minimum", "maximum",
        "minLength", "maxLength", "minItems", "maxItems", "x-kubernetes-int-or-string",
        "x-kubernetes-preserve-unknown-fields"}
# Fields no manifest sets but the suite's checks read (its broken copies set them)
READ_BY_CHECKS = {
    "spec": {
        "serveService": {"spec": {"type": "", "ports": [{"name": "", "port": 0}]}},
        "upgradeStrategy": {"type": ""},
        "rayClusterConfig": {
            "authOptions": {"mode": ""},
            "gcsFaultToleranceOptions": {"redisAddress": ""},
            "headGroupSpec": {"serviceType": "", "enableIngress": False,
                              "template": {"spec": {"containers": [{"ports": [{"hostPort": 0}]}]}}},
            "workerGroupSpecs": [{"resources": {"": ""}, "suspend": False}],
        },
    },
}


def crd_dir() -> Path | None:
    """KubeRay's CRDs, if this machine has them: $KUBERAY_CRDS_DIR where set, else ../shared/kuberay-crds."""
    path = Path(os.environ.get("KUBERAY_CRDS_DIR") or ROOT.parent / "shared" / "kuberay-crds")
    return path if (path / CRD_FILE).is_file() else None


def full_schema(crds: Path) -> dict:
    """The served v1 openAPIV3Schema of KubeRay's RayService CRD."""
    crd = yaml.load((crds / CRD_FILE).read_text(), Loader=Loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1" and v["served"]]
    return version["schema"]["openAPIV3Schema"]


def usage(objects: list) -> dict:
    """The union of the objects' field trees: {key: subtree}; a list's items merge under "[]"."""
    tree: dict = {}

    def add(obj, node: dict) -> None:
        if isinstance(obj, dict):
            for key, value in obj.items():
                add(value, node.setdefault(key, {}))
        elif isinstance(obj, list):
            for item in obj:
                add(item, node.setdefault("[]", {}))
    for obj in objects:
        add(obj, tree)
    return tree


def _merge(into: dict, tree: dict) -> None:
    for key, sub in tree.items():
        _merge(into.setdefault(key, {}), sub)


def prune(schema: dict, used: dict) -> dict:
    """`schema` cut to the fields in `used`, without descriptions or CEL rules."""
    out = {k: v for k, v in schema.items() if k in KEPT}
    if "properties" in schema:
        out["properties"] = {k: prune(s, used.get(k, {})) for k, s in schema["properties"].items() if k in used}
        if "required" in schema:
            out["required"] = [k for k in schema["required"] if k in out["properties"]]
    if isinstance(schema.get("additionalProperties"), dict):  # a map: every key's value shares one schema
        merged: dict = {}
        for key, sub in used.items():
            if key not in schema.get("properties", {}):
                _merge(merged, sub)
        out["additionalProperties"] = prune(schema["additionalProperties"], merged)
    elif "additionalProperties" in schema:
        out["additionalProperties"] = schema["additionalProperties"]
    if isinstance(schema.get("items"), dict):
        out["items"] = prune(schema["items"], used.get("[]", {}))
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            out[key] = [prune(s, used) for s in schema[key]]
    return out


def used_schema(schema: dict, objects: list) -> dict:
    """The part of `schema` that `objects` (stored RayServices) and `READ_BY_CHECKS` reach."""
    return prune(schema, usage([*objects, READ_BY_CHECKS]))


def load_used_schema() -> dict:
    return json.loads(USED_SCHEMA.read_text())


def render(schema: dict) -> str:
    return json.dumps({"kuberay": KUBERAY_VERSION, "kind": "RayService", "version": "v1",
                       "schema": schema}, indent=1, sort_keys=True) + "\n"


def strict(s):
    """A schema with unknown fields refused (kubectl --validate=strict) and int ranges added."""
    if isinstance(s, list):
        return [strict(x) for x in s]
    if not isinstance(s, dict):
        return s
    out = dict(s)
    if "properties" in s:
        out["properties"] = {k: strict(v) for k, v in s["properties"].items()}
        if not s.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in s:
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(s.get(key), dict):
            out[key] = strict(s[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in s:
            out[key] = strict(s[key])
    bits = {"int32": 31, "int64": 63}.get(s.get("format"))
    if bits and s.get("type") == "integer":
        out.setdefault("minimum", -(2 ** bits))
        out.setdefault("maximum", 2 ** bits - 1)
    if s.get("nullable") and "type" in s:
        out["type"] = [s["type"], "null"]
    return out


def apiserver(obj, s: dict):
    """What the API server stores: nulls of non-nullable fields dropped, absent defaults filled."""
    if isinstance(obj, dict):
        props = s.get("properties", {})
        extra = s["additionalProperties"] if isinstance(s.get("additionalProperties"), dict) else {}
        out = {}
        for key, value in obj.items():
            sub = props.get(key, extra)
            if value is None and not sub.get("nullable"):
                continue
            out[key] = apiserver(value, sub)
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = apiserver(copy.deepcopy(sub["default"]), sub)
        return out
    if isinstance(obj, list) and isinstance(s.get("items"), dict):
        return [apiserver(x, s["items"]) for x in obj]
    return obj


def committed_manifests() -> list[dict]:
    """The RayService of every committed manifest (k8s/ray-service.*.yaml)."""
    return [d for p in sorted((ROOT / "k8s").glob("ray-service.*.yaml"))
            for d in yaml.load_all(p.read_text(), Loader=Loader) if d]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--crds", type=Path, default=crd_dir(), help="directory holding " + CRD_FILE)
    args = p.parse_args()
    if args.crds is None:
        raise SystemExit(f"KubeRay's CRDs not found: pass --crds DIR (holding {CRD_FILE}) or set KUBERAY_CRDS_DIR")
    schema = full_schema(args.crds)
    USED_SCHEMA.parent.mkdir(exist_ok=True)
    stored = [apiserver(rs, schema) for rs in committed_manifests()]
    USED_SCHEMA.write_text(render(used_schema(schema, stored)))
    print(f"wrote {USED_SCHEMA.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
