"""The KubeRay manifests (k8s/): what the API server, the KubeRay operator and Ray Serve would say.

No cluster runs here, so each layer is checked offline: the RayService schema (the project's cut
of KubeRay's CRD in k8s/schema, strict, after the API server's pruning and defaulting; KubeRay's
full CRD too where KUBERAY_CRDS_DIR or ../shared/kuberay-crds has it), the operator's own validation, the Serve config (Ray's schema,
strict, and the app's typed args), and the consistency between them (pools, GPUs, exposure).
Broken copies of a manifest must fail the same checks.
"""

import functools
import importlib
import json
import math
import os
import re
import typing
from pathlib import Path

import jsonschema
import pydantic
import pytest
import torch
import yaml

from cluster import crd_schema as crds
from cluster import dashboard as dash
from cluster import k8s as gen
from cluster.crd_schema import apiserver, strict

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
MANIFESTS = sorted(K8S.glob("ray-service.*.yaml"))
# the pools: which deployment asks for which custom resource
INTENDED = {"DraftServer": gen.DRAFT_POOL, "TargetServer": gen.TARGET_POOL}
INTERNAL_PORTS = {6379, 8265, 10001}  # GCS, dashboard, client: never outside the cluster
SPEC_METRICS = ([f"ray_specserve_{n}_total" for n in dash.COUNTERS]
                + [f"ray_specserve_{n}_{s}" for n in dash.HISTOGRAMS for s in ("bucket", "sum", "count")]
                + [f"ray_specserve_{n}" for n in dash.GAUGES])
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ManifestError(ValueError):
    """A manifest the API server, the operator or Ray Serve would refuse (or run wrongly)."""


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ManifestError(message)


def load(path: Path) -> dict:
    """The one RayService document of a manifest file."""
    docs = [d for d in yaml.load_all(path.read_text(), Loader=Loader) if d]
    assert len(docs) == 1, f"{path.name}: expected one document, found {len(docs)}"
    return docs[0]


# --- the API server: pruning, defaulting, strict schema -------------------------------------------

@functools.cache
def rayservice_schema() -> dict:
    """The RayService schema of the fields the project uses (k8s/schema, cut from KubeRay's CRD), strict."""
    return strict(crds.load_used_schema()["schema"])


@functools.cache
def kuberay_schema() -> dict:
    """KubeRay's full RayService schema, strict, where this machine has the CRDs; else the test skips."""
    found = crds.crd_dir()
    if found is None:
        pytest.skip(f"KubeRay's CRDs are not here: set KUBERAY_CRDS_DIR to a directory holding "
                    f"{crds.CRD_FILE} (kuberay {crds.KUBERAY_VERSION}, ray-operator/config/crd/bases) "
                    "to check the manifests against the full schema as well")
    return strict(crds.full_schema(found))


def schema_errors(rs: dict, schema: dict) -> tuple[dict, list[str]]:
    """(what the API server stores, the schema's violations of it)."""
    stored = apiserver(rs, schema)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(stored), key=lambda e: list(e.path))
    return stored, [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]


def validate_schema(rs: dict, schema: dict | None = None) -> dict:
    """The stored object, or ManifestError listing the schema's violations (the project's schema
    unless another is given)."""
    check(rs.get("apiVersion") == "ray.io/v1" and rs.get("kind") == "RayService",
          f"expected apiVersion ray.io/v1, kind RayService; got {rs.get('apiVersion')} {rs.get('kind')}")
    stored, errors = schema_errors(rs, schema or rayservice_schema())
    hint = "" if schema else " (k8s/schema lists the fields the project uses: a new one needs python -m cluster.crd_schema)"
    check(not errors, "; ".join(errors[:5]) + hint)
    return stored


# --- the operator's own rules (ray-operator/controllers/ray/utils/validation.go) -------------------

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
GO_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")
RAY_RESOURCE_PARAMS = ("num-cpus", "num-gpus", "memory", "resources")
UPGRADE_TYPES = {"NewCluster", "None", "NewClusterWithIncrementalUpgrade"}


def groups(rs: dict) -> list[tuple[str, dict]]:
    cluster = rs["spec"]["rayClusterConfig"]
    return [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster.get("workerGroupSpecs", [])]


def containers(group: dict) -> list[dict]:
    return group["template"]["spec"].get("containers", [])


def version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def operator_rules(rs: dict) -> None:
    """What the KubeRay operator refuses although the schema lets it through."""
    meta, spec = rs["metadata"], rs["spec"]
    cluster = spec["rayClusterConfig"]
    name = meta.get("name", "")
    check(len(name) <= 47, f"RayService name {name!r} is {len(name)} characters; at most 47 (the cluster adds 6)")
    check(bool(DNS1035.match(name)), f"RayService name {name!r} is not a DNS-1035 label")
    timeout = (meta.get("annotations") or {}).get("ray.io/initializing-timeout")
    if timeout:
        check(bool(GO_DURATION.match(timeout)) or (timeout.isdigit() and int(timeout) > 0),
              f"ray.io/initializing-timeout {timeout!r}: a Go duration (45m) or positive seconds")
    kind = (spec.get("upgradeStrategy") or {}).get("type")
    check(kind is None or kind in UPGRADE_TYPES, f"upgradeStrategy.type {kind!r} not in {sorted(UPGRADE_TYPES)}")
    if kind == "NewClusterWithIncrementalUpgrade":
        check(cluster.get("enableInTreeAutoscaling") is True, "incremental upgrade needs the autoscaler")
        check(bool(spec["upgradeStrategy"].get("clusterUpgradeOptions")), "incremental upgrade needs clusterUpgradeOptions")
    config = yaml.safe_load(spec.get("serveConfigV2") or "")
    check(isinstance(config, dict) and isinstance(config.get("applications"), list) and config["applications"],
          "serveConfigV2 must be YAML with a non-empty `applications` list")
    check(not ((cluster["headGroupSpec"].get("headService") or {}).get("metadata") or {}).get("name"),
          "headService.metadata.name must not be set in a RayService")
    names = [g["groupName"] for g in cluster.get("workerGroupSpecs", [])]
    check(len(names) == len(set(names)), f"worker group names repeat: {names}")
    for gname, g in groups(rs):
        check(bool(containers(g)), f"{gname} group has no container")
        params = g.get("rayStartParams") or {}
        check(not (any(params.get(k) for k in RAY_RESOURCE_PARAMS) and g.get("resources")),
              f"{gname} group sets resources in both rayStartParams and `resources`; use one")
        check("labels" not in params, f"{gname} group: use the `labels` field, not rayStartParams['labels']")
        if gname != "head":
            lo, hi = g.get("minReplicas", 0), g.get("maxReplicas", 2 ** 31 - 1)
            check(lo <= hi, f"{gname} group: minReplicas {lo} > maxReplicas {hi}")
            check(g.get("replicas") is None or lo <= g["replicas"] <= hi,
                  f"{gname} group: replicas {g.get('replicas')} outside [{lo}, {hi}]")
            check(not (g.get("suspend") and cluster.get("enableInTreeAutoscaling")),
                  f"{gname} group cannot be suspended with the autoscaler on")
    head_env = {e["name"] for e in containers(cluster["headGroupSpec"])[0].get("env", [])}
    if cluster.get("gcsFaultToleranceOptions"):
        check("redis-password" not in (cluster["headGroupSpec"].get("rayStartParams") or {}),
              "with gcsFaultToleranceOptions set the Redis password there, not in rayStartParams")
        check(not head_env & {"REDIS_PASSWORD", "RAY_REDIS_ADDRESS"},
              "with gcsFaultToleranceOptions do not set REDIS_PASSWORD / RAY_REDIS_ADDRESS on the head")
        check("ray.io/ft-enabled" not in (meta.get("annotations") or {}), "ft-enabled annotation and options both set")
    else:
        check("RAY_REDIS_ADDRESS" not in head_env, "RAY_REDIS_ADDRESS needs gcsFaultToleranceOptions")
    if (cluster.get("authOptions") or {}).get("mode") == "token":
        check(version_tuple(cluster.get("rayVersion", "0")) >= (2, 52, 0), "token auth needs rayVersion >= 2.52.0")


# --- the Serve config --------------------------------------------------------------------------------

def model_classes(annotation) -> list[type]:
    """The pydantic models inside an annotation (Optional[X], List[X], Union[dict, X], ...)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in model_classes(arg)]


def unknown_keys(model: type, data, path: str) -> list[str]:
    """Keys Ray's schema would silently ignore (a typo there is a setting that never applies)."""
    if isinstance(data, list):
        return [k for i, x in enumerate(data) for k in unknown_keys(model, x, f"{path}[{i}]")]
    if not isinstance(data, dict):
        return []
    fields = model.model_fields
    known = set(fields) | {f.alias for f in fields.values() if f.alias}
    out = [f"{path}.{k}" for k in data if k not in known]
    for key, value in data.items():
        if key in fields and key != "args":
            for sub in model_classes(fields[key].annotation)[:1]:
                out += unknown_keys(sub, value, f"{path}.{key}")
    return out


def serve_rules(rs: dict) -> dict:
    """serveConfigV2 as Ray Serve and build_app would take it; the parsed config."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    from deployments.args import AppConfig

    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    try:
        ServeDeploySchema.model_validate(config)
    except pydantic.ValidationError as e:
        raise ManifestError(f"serveConfigV2: {e}") from e
    typos = unknown_keys(ServeDeploySchema, config, "serveConfigV2")
    check(not typos, f"unknown fields (Ray would ignore them): {typos}")
    check(config.get("http_options", {}).get("host") == "0.0.0.0", "http_options.host must be 0.0.0.0 in a pod")
    check(config.get("http_options", {}).get("port", 8000) == gen.SERVE_PORT, "Serve must listen on 8000")
    for app in config["applications"]:
        for d in app.get("deployments", []):
            if "autoscaling_config" in d:
                try:
                    AutoscalingConfig(**d["autoscaling_config"])
                except pydantic.ValidationError as e:
                    raise ManifestError(f"{d['name']}.autoscaling_config: {e}") from e
        module, _, attr = app["import_path"].partition(":")
        check(callable(getattr(importlib.import_module(module), attr, None)), f"{app['import_path']} not found")
        try:
            AppConfig.model_validate(app.get("args") or {})
        except pydantic.ValidationError as e:
            raise ManifestError(f"args: {e}") from e
    return config


# --- consistency between the pods and the application -----------------------------------------------

def offered(group: dict) -> dict[str, float]:
    """Custom resources a group's pods advertise to Ray."""
    raw = (group.get("rayStartParams") or {}).get("resources")
    out = json.loads(raw.strip('"').replace('\\"', '"')) if raw else {}
    out.update({k: float(v) for k, v in (group.get("resources") or {}).items() if k not in ("CPU", "GPU", "memory")})
    return out


def gpus(group: dict) -> tuple[int, int, int | None]:
    """(requested, limited, Ray num-gpus) GPUs of a group's Ray container."""
    res = containers(group)[0].get("resources", {})
    req, lim = (int(res.get(k, {}).get("nvidia.com/gpu", 0)) for k in ("requests", "limits"))
    ray = (group.get("rayStartParams") or {}).get("num-gpus") or (group.get("resources") or {}).get("GPU")
    return req, lim, None if ray is None else int(float(ray))


def replica_bounds(d: dict) -> tuple[int, int]:
    a = d.get("autoscaling_config")
    return (a.get("min_replicas", 1), a.get("max_replicas", 1)) if a else (d.get("num_replicas", 1),) * 2


def consistency_rules(rs: dict) -> None:
    """Pools pinned, capacity for every replica, GPUs agreeing, ports kept inside, secrets by reference."""
    cluster = rs["spec"]["rayClusterConfig"]
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    app = config["applications"][0]
    deps = {d["name"]: d for d in app["deployments"]}
    by_name = dict(groups(rs))
    check((cluster["headGroupSpec"].get("rayStartParams") or {}).get("num-cpus") == "0",
          "the head must do no work: rayStartParams num-cpus '0'")
    for dname, resource in INTENDED.items():
        asks = deps[dname].get("ray_actor_options", {}).get("resources", {})
        check(set(asks) == {resource}, f"{dname} must ask for {resource} only; asks {sorted(asks)}")
        offering = [g for g, spec in by_name.items() if resource in offered(spec)]
        check(len(offering) == 1 and offering[0] != "head",
              f"{resource} must be offered by exactly one worker group; offered by {offering}")
        group = by_name[offering[0]]
        slots = math.floor(offered(group)[resource] / asks[resource])
        lo, hi = replica_bounds(deps[dname])
        check(group.get("maxReplicas", 2 ** 31 - 1) * slots >= hi,
              f"{dname} may have {hi} replicas but group {offering[0]} holds at most "
              f"{group.get('maxReplicas')} x {slots}")
        check(group.get("minReplicas", 0) * slots >= lo,
              f"{dname} keeps {lo} replicas but group {offering[0]} keeps only {group.get('minReplicas', 0)} pods")
    for other, d in deps.items():
        asks = set(d.get("ray_actor_options", {}).get("resources", {}))
        check(other in INTENDED or not asks & set(INTENDED.values()), f"{other} asks for a pool resource")
    for gname, g in by_name.items():
        req, lim, ray = gpus(g)
        check(req == lim, f"{gname}: GPU requests {req} != limits {lim}")
        check(ray is None or ray == lim, f"{gname}: Ray num-gpus {ray} != container GPUs {lim}")
        if lim:
            tolerated = {t.get("key") for t in g["template"]["spec"].get("tolerations", [])}
            check("nvidia.com/gpu" in tolerated, f"{gname}: GPU pods need the nvidia.com/gpu toleration")
    target = by_name[next(g for g, s in by_name.items() if gen.TARGET_POOL in offered(s))]
    tp = app["args"].get("target", {}).get("tensor_parallel_size", 1)
    _, target_gpus, _ = gpus(target)
    check(target_gpus in (0, tp), f"target tensor_parallel_size {tp} != GPUs per target pod {target_gpus}")
    check(not deps["TargetServer"].get("ray_actor_options", {}).get("num_gpus"),
          "TargetServer's GPUs belong to its rank workers' placement group, not the replica actor")
    if tp > 1:  # the placement group build_app reserves must fit the pod and hold the replica
        from deployments.application import tensor_parallel_options
        from deployments.args import AppConfig

        bundles = tensor_parallel_options(AppConfig.model_validate(app["args"]))["placement_group_bundles"]
        check(sum(b.get("GPU", 0) for b in bundles) == target_gpus,
              f"rank bundles ask {sum(b.get('GPU', 0) for b in bundles)} GPUs; target pods have {target_gpus}")
        replica_cpus = deps["TargetServer"].get("ray_actor_options", {}).get("num_cpus", 1)
        rank_cpus = app["args"]["target"].get("rank_resources", {}).get("CPU", 0.25)
        check(bundles[0].get("CPU", 0) >= replica_cpus + rank_cpus,
              f"bundle 0 ({bundles[0]}) cannot hold the TargetServer replica ({replica_cpus} CPU) and rank 0")
    draft = by_name[next(g for g, s in by_name.items() if gen.DRAFT_POOL in offered(s))]
    draft_gpus = deps["DraftServer"].get("ray_actor_options", {}).get("num_gpus", 0)
    check(draft_gpus <= gpus(draft)[1], f"DraftServer asks {draft_gpus} GPUs; its pods have {gpus(draft)[1]}")
    check(bool(gpus(draft)[1]) == bool(draft_gpus), "draft pods with GPUs should run DraftServer on one")
    if any("autoscaling_config" in d for d in deps.values()):
        check(cluster.get("enableInTreeAutoscaling") is True, "Serve autoscaling needs enableInTreeAutoscaling")
    version = cluster["rayVersion"]
    for gname, g in by_name.items():
        for c in containers(g):
            tag = c["image"].rpartition(":")[2]
            check(f"ray{version}-" in tag or tag.startswith(f"{version}-"),
                  f"{gname}: image {c['image']} does not match rayVersion {version}")
            check(tag.endswith("-gpu") or not gpus(g)[1], f"{gname}: GPU pods need the -gpu image (CUDA)")
            for e in c.get("env", []):
                check(not (re.search(r"TOKEN|KEY|PASSWORD|SECRET", e["name"]) and "value" in e),
                      f"{gname}: {e['name']} inline; use valueFrom.secretKeyRef")
    exposure_rules(rs)


def exposure_rules(rs: dict) -> None:
    """Only the Serve port leaves the cluster network; dashboard, GCS and client stay inside."""
    spec, cluster = rs["spec"], rs["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    check(head.get("serviceType", "ClusterIP") == "ClusterIP", "the head Service must stay ClusterIP")
    check(((head.get("headService") or {}).get("spec") or {}).get("type", "ClusterIP") == "ClusterIP",
          "the head Service must stay ClusterIP")
    check(not head.get("enableIngress"), "no Ingress to the head (it would expose the dashboard)")
    serve_ports = {p.get("port") for p in ((spec.get("serveService") or {}).get("spec") or {}).get("ports", [])}
    check(serve_ports <= {gen.SERVE_PORT}, f"the serve Service exposes {sorted(serve_ports)}; only 8000")
    for gname, g in groups(rs):
        pod = g["template"]["spec"]
        check(not pod.get("hostNetwork"), f"{gname}: hostNetwork would expose every Ray port")
        for c in containers(g):
            for p in c.get("ports", []):
                check("hostPort" not in p, f"{gname}: hostPort {p.get('hostPort')} exposes port {p['containerPort']}")


# the models and GPUs the manifests name: parameters, and memory as the device reports it
def memory_rules(rs: dict) -> None:
    """On GPU pools each model's weights (per rank), working buffers and KV cache fit its GPU's
    memory_utilization share, and the KV cache holds one sequence of max_model_len: `specserve plan`'s
    figures (specserve/plan.py: the models' real configs on the meta device, app/model/memory.py's formulas)."""
    from specserve.plan import _manifest_gpus, plan_app

    serve = yaml.safe_load(rs["spec"]["serveConfigV2"])
    for row in plan_app(serve["applications"][0]["args"], _manifest_gpus(rs, serve)):
        check(row.fits, f"{row.name} on {row.gpu}: {row.why}")


def validate(rs: dict) -> dict:
    """Every check, in the order a deploy meets them; the parsed Serve config."""
    validate_schema(rs)
    operator_rules(rs)
    config = serve_rules(rs)
    consistency_rules(rs)
    memory_rules(rs)
    return config


# --- the committed manifests ---------------------------------------------------------------------------

def test_ray_version_matches_installed_ray():
    import ray

    assert gen.RAY_VERSION == ray.__version__, "bump RAY_VERSION in cluster/k8s.py and regenerate"
    dockerfile = (K8S / "Dockerfile").read_text()
    assert f"ARG RAY_IMAGE=rayproject/ray:{gen.RAY_VERSION}-py311-gpu" in dockerfile


def test_every_variant_is_committed():
    assert {p.name for p in MANIFESTS} == {v.file for v in gen.VARIANTS}
    for v in gen.VARIANTS:
        assert (K8S / v.file).read_text().startswith("# "), f"{v.file}: open with what it is for"


@pytest.mark.parametrize("name", sorted(gen.outputs()))
def test_committed_files_match_the_generator(name):
    assert (K8S / name).read_text() == gen.outputs()[name], f"k8s/{name} is stale: run python -m cluster.k8s"


@pytest.mark.parametrize("variant", gen.VARIANTS, ids=lambda v: v.file)
def test_every_ray_container_runs_serves_throughput_profile(variant):
    from cluster.local import SERVE_ENV

    rs = load(K8S / variant.file)
    for name, group in groups(rs):
        for c in containers(group):
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert {k: env.get(k) for k in SERVE_ENV} == SERVE_ENV, f"{variant.file}: {name}"


def test_the_local_clusters_driver_keeps_serves_defaults(monkeypatch):
    from cluster.local import SERVE_ENV, _environment

    for k in SERVE_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0")  # a user's own choice is kept
    with _environment({**SERVE_ENV, "SPECSERVE_TEST_ONLY": "1"}):
        assert os.environ["SPECSERVE_TEST_ONLY"] == "1" and os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "0"
    assert "SPECSERVE_TEST_ONLY" not in os.environ and os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "0"


@pytest.mark.parametrize("variant", gen.VARIANTS, ids=lambda v: v.file)
def test_serve_config_is_the_source_config(variant):
    rs = load(K8S / variant.file)
    embedded = yaml.safe_load(rs["spec"]["serveConfigV2"])
    assert embedded == gen.serve_config(variant)
    source = yaml.safe_load(gen.CONFIG.read_text())
    app, src = embedded["applications"][0], source["applications"][0]
    assert {k: v for k, v in app.items() if k not in ("args", "deployments")} == \
        {k: v for k, v in src.items() if k not in ("args", "deployments")}
    assert [d["name"] for d in app["deployments"]] == [d["name"] for d in src["deployments"]]
    assert set(app["args"]) == set(src["args"]) | set(variant.args)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid(path):
    config = validate(load(path))
    assert {d["name"] for d in config["applications"][0]["deployments"]} >= set(INTENDED)


def test_api_server_preprocessing_is_modelled():
    rs = load(K8S / "ray-service.gpu.yaml")
    rs["spec"]["suspend"] = None  # not nullable: dropped, not refused
    del rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplicas"]  # required, with a default
    stored = validate_schema(rs)
    assert "suspend" not in stored["spec"]
    assert stored["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplicas"] == 0  # the default


def test_gpu_shapes():
    rs = load(K8S / "ray-service.gpu.yaml")
    by_name = dict(groups(rs))
    assert gpus(by_name["target-gpu"]) == (gen.TP, gen.TP, gen.TP)
    assert gpus(by_name["draft-gpu"]) == (1, 1, 1)
    assert gpus(by_name["head"]) == (0, 0, None)
    dev = load(K8S / "ray-service.dev-cpu.yaml")
    assert all(gpus(g)[1] == 0 for _, g in groups(dev))
    assert yaml.safe_load(dev["spec"]["serveConfigV2"])["applications"][0]["args"]["target"]["model"] is None


def test_ha_and_auth_variants():
    ha = load(K8S / "ray-service.ha.yaml")["spec"]["rayClusterConfig"]
    ref = ha["gcsFaultToleranceOptions"]["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "specserve-redis", "key": "password"}
    auth = load(K8S / "ray-service.auth.yaml")["spec"]["rayClusterConfig"]
    assert auth["authOptions"]["mode"] == "token"


# --- broken manifests must fail --------------------------------------------------------------------------

def gpu_manifest() -> dict:
    return load(K8S / "ray-service.gpu.yaml")


def edit_serve(rs: dict, fn) -> None:
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    fn(config, {d["name"]: d for d in config["applications"][0]["deployments"]})
    rs["spec"]["serveConfigV2"] = yaml.safe_dump(config, sort_keys=False)


def worker(rs: dict, i: int) -> dict:
    return rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][i]


def set_target_gpus(rs, req, lim):
    res = worker(rs, 1)["template"]["spec"]["containers"][0]["resources"]
    res["requests"]["nvidia.com/gpu"], res["limits"]["nvidia.com/gpu"] = str(req), str(lim)


BROKEN = {
    "typo in a worker group": lambda rs: worker(rs, 0).update(minReplica=1),
    "typo in the pod template": lambda rs: worker(rs, 0)["template"]["spec"].update(nodeSelecter={"a": "b"}),
    "typo in a container": lambda rs: worker(rs, 0)["template"]["spec"]["containers"][0].update(imag="x"),
    "bad quantity": lambda rs: worker(rs, 0)["template"]["spec"]["containers"][0]["resources"]["limits"]
    .update(memory="32 GB"),
    "int32 overflow": lambda rs: worker(rs, 0).update(maxReplicas=2 ** 31),
    "min > max pods": lambda rs: worker(rs, 1).update(minReplicas=5, maxReplicas=2, replicas=2),
    "name too long": lambda rs: rs["metadata"].update(name="specserve-" + "x" * 40),
    "name not DNS-1035": lambda rs: rs["metadata"].update(name="Specserve_prod"),
    "bad initializing timeout": lambda rs: rs["metadata"]["annotations"].update({"ray.io/initializing-timeout": "soon"}),
    "resources set twice": lambda rs: worker(rs, 0).update(resources={"GPU": "1"}),
    "upgrade strategy type": lambda rs: rs["spec"]["upgradeStrategy"].update(type="BlueGreen"),
    "serveConfigV2 without applications": lambda rs: rs["spec"].update(serveConfigV2="proxy_location: EveryNode\n"),
    "redis password in rayStartParams": lambda rs: (
        rs["spec"]["rayClusterConfig"].update(gcsFaultToleranceOptions={"redisAddress": "redis:6379"}),
        rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update({"redis-password": "x"})),
    "typo in serve autoscaling": lambda rs: edit_serve(
        rs, lambda c, d: d["DraftServer"]["autoscaling_config"].update(max_replica=3)),
    "typo in a serve deployment": lambda rs: edit_serve(rs, lambda c, d: d["Ingress"].update(num_replica=2)),
    "typo in ray_actor_options": lambda rs: edit_serve(
        rs, lambda c, d: d["DraftServer"]["ray_actor_options"].update(num_gpu=1)),
    "typo in app args": lambda rs: edit_serve(
        rs, lambda c, d: c["applications"][0]["args"]["target"].update(tensor_paralel_size=4)),
    "serve min > max replicas": lambda rs: edit_serve(
        rs, lambda c, d: d["TargetServer"]["autoscaling_config"].update(min_replicas=3, max_replicas=2)),
    "import_path missing": lambda rs: edit_serve(
        rs, lambda c, d: c["applications"][0].update(import_path="deployments.application:no_such_builder")),
    "serve bound to loopback": lambda rs: edit_serve(rs, lambda c, d: c["http_options"].update(host="127.0.0.1")),
    "tensor parallel != pod GPUs": lambda rs: edit_serve(
        rs, lambda c, d: c["applications"][0]["args"]["target"].update(tensor_parallel_size=8)),
    "pod GPUs != tensor parallel": lambda rs: (set_target_gpus(rs, 8, 8),
                                              worker(rs, 1)["rayStartParams"].update({"num-gpus": "8"})),
    "GPU requests != limits": lambda rs: set_target_gpus(rs, 2, 4),
    "Ray num-gpus != container GPUs": lambda rs: worker(rs, 1)["rayStartParams"].update({"num-gpus": "2"}),
    "TargetServer actor takes a GPU": lambda rs: edit_serve(
        rs, lambda c, d: d["TargetServer"]["ray_actor_options"].update(num_gpus=1)),
    "pool offered by two groups": lambda rs: worker(rs, 1)["rayStartParams"].update(
        resources='"{\\"target_pool\\": 1, \\"draft_pool\\": 1}"'),
    "draft asks the target pool": lambda rs: edit_serve(
        rs, lambda c, d: d["DraftServer"]["ray_actor_options"].update(resources={"target_pool": 1})),
    "too few pods for max replicas": lambda rs: worker(rs, 0).update(maxReplicas=2),
    "head does work": lambda rs: rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].pop("num-cpus"),
    "image tag != rayVersion": lambda rs: worker(rs, 0)["template"]["spec"]["containers"][0].update(
        image="rayproject/ray:2.9.0-py311-gpu"),
    "HF token inline": lambda rs: worker(rs, 0)["template"]["spec"]["containers"][0]["env"].__setitem__(
        0, {"name": "HF_TOKEN", "value": "hf_abc"}),
    "dashboard via LoadBalancer": lambda rs: rs["spec"]["rayClusterConfig"]["headGroupSpec"].update(
        serviceType="LoadBalancer"),
    "dashboard via the serve Service": lambda rs: rs["spec"].update(serveService={"spec": {"type": "LoadBalancer", "ports": [
        {"name": "serve", "port": 8000}, {"name": "dashboard", "port": 8265}]}}),
    "dashboard via hostPort": lambda rs: rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"][
        "containers"][0]["ports"][1].update(hostPort=8265),
    "head Ingress": lambda rs: rs["spec"]["rayClusterConfig"]["headGroupSpec"].update(enableIngress=True),
    "token auth on old Ray": lambda rs: rs["spec"]["rayClusterConfig"].update(
        authOptions={"mode": "token"}, rayVersion="2.50.0"),
    "target max_model_len beyond what its KV cache holds": lambda rs: edit_serve(
        rs, lambda c, d: c["applications"][0]["args"]["target"].update(max_model_len=600_000)),
    "target KV cap below the admitted context": lambda rs: edit_serve(
        rs, lambda c, d: c["applications"][0]["args"]["target"].update(max_cache_bytes=1 << 30)),
    "draft at a memory utilization its weights and buffers fill": lambda rs: edit_serve(
        rs, lambda c, d: c["applications"][0]["args"]["draft"].update(memory_utilization=0.25)),
}


@pytest.mark.parametrize("breakage", sorted(BROKEN))
def test_broken_manifest_fails(breakage):
    rs = gpu_manifest()
    BROKEN[breakage](rs)
    with pytest.raises(ManifestError):
        validate(rs)


# --- the project's schema against KubeRay's own CRD (where this machine has it) -----------------------

@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_against_kuberays_own_crd(path):
    validate_schema(load(path), kuberay_schema())


def test_the_projects_schema_is_what_kuberays_crd_gives():
    kuberay_schema()  # skips without the CRDs
    schema = crds.full_schema(crds.crd_dir())
    stored = [apiserver(rs, schema) for rs in crds.committed_manifests()]
    assert crds.render(crds.used_schema(schema, stored)) == crds.USED_SCHEMA.read_text(), \
        "k8s/schema is stale: run python -m cluster.crd_schema"


@pytest.mark.parametrize("breakage", sorted(BROKEN))
def test_the_projects_schema_judges_a_broken_copy_as_kuberays_does(breakage):
    rs = gpu_manifest()
    BROKEN[breakage](rs)
    ours, theirs = schema_errors(rs, rayservice_schema())[1], schema_errors(rs, kuberay_schema())[1]
    assert bool(ours) == bool(theirs), f"ours: {ours[:2]}; KubeRay's: {theirs[:2]}"


def test_the_projects_schema_refuses_fields_it_does_not_know():
    rs = gpu_manifest()
    worker(rs, 0)["template"]["spec"]["shareProcessNamespace"] = True  # a real Pod field the project never sets
    assert schema_errors(rs, rayservice_schema())[1]


# --- monitoring -------------------------------------------------------------------------------------------

def test_pod_monitor_selects_every_ray_pod_on_the_metrics_port():
    pm, _ = [d for d in yaml.safe_load_all((K8S / "monitoring.yaml").read_text()) if d]
    assert pm["kind"] == "PodMonitor" and pm["apiVersion"] == "monitoring.coreos.com/v1"
    wanted = pm["spec"]["selector"]["matchLabels"]
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    for path in MANIFESTS:
        for gname, g in groups(load(path)):
            labels = {**g["template"]["metadata"]["labels"], "ray.io/is-ray-node": "yes"}  # KubeRay adds the latter
            assert wanted.items() <= labels.items(), f"{path.name} {gname}: not selected"
            ports = {p["name"]: p["containerPort"] for p in containers(g)[0]["ports"]}
            assert ports.get(endpoint["port"]) == gen.METRICS_PORT, f"{path.name} {gname}: no metrics port"
    targets = {r["targetLabel"] for r in endpoint["relabelings"]}
    assert {"ray_io_cluster", "ray_io_group"} <= targets  # the dashboard filters and groups by them


def test_vllm_names_are_scraped_once_from_the_heads_serve_port():
    """Every ingress replica serves the app's totals: one pod per cluster (the head, which runs a
    proxy), on the port each manifest's head container names `serve`."""
    _, pm = [d for d in yaml.safe_load_all((K8S / "monitoring.yaml").read_text()) if d]
    assert pm["kind"] == "PodMonitor" and pm["spec"]["selector"]["matchLabels"]["ray.io/node-type"] == "head"
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for path in MANIFESTS:
        head = load(path)["spec"]["rayClusterConfig"]["headGroupSpec"]
        assert pm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/part-of"] == \
            head["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"]
        ports = {p["name"]: p["containerPort"] for p in containers(head)[0]["ports"]}
        assert ports.get(endpoint["port"]) == 8000, path.name


def test_grafana_dashboard_uses_the_exported_metric_names():
    board = json.loads((K8S / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    used = set(re.findall(r"\bray_specserve_\w+", " ".join(exprs)))
    assert used <= set(SPEC_METRICS), f"names Ray does not export: {used - set(SPEC_METRICS)}"
    bases = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}
    assert bases == {f"ray_specserve_{n}" for n in dash.COUNTERS + dash.HISTOGRAMS + dash.GAUGES}
    assert any("ray_serve_deployment_replica_healthy" in e for e in exprs)
    vllm = {re.sub(r"_(bucket|sum|count)$", "", n) for n in re.findall(r"\bvllm:(\w+)", " ".join(exprs))}
    assert vllm == set(dash.VLLM_HISTOGRAMS + dash.VLLM_GAUGES)
    from deployments.vllm_metrics import VLLM_HISTOGRAMS
    assert set(dash.VLLM_HISTOGRAMS) <= set(VLLM_HISTOGRAMS)  # names /metrics serves
    for e in exprs:
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
    titles = " ".join(p["title"].lower() for p in board["panels"])
    for topic in ("acceptance", "tokens per second", "draft", "verify", "batch", "replicas", "time to first token",
                  "time per output token", "end-to-end", "waiting", "kv cache usage"):
        assert topic in titles
