"""KubeRay manifests generated from the Serve config: one RayService per scenario under k8s/.

    python -m cluster.k8s            # write k8s/ray-service.*.yaml and k8s/grafana-dashboard.json
    python -m cluster.k8s --check    # exit 1 when a committed file differs from what would be written

cluster/serve_config.yaml is the one source of truth for the application; each variant embeds it
in serveConfigV2 with a few overrides (models, tensor parallelism, GPUs per replica, bind address).
"""

import argparse
import copy
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cluster.dashboard import dashboard
from cluster.local import SERVE_ENV

CONFIG = Path(__file__).with_name("serve_config.yaml")
OUT = Path(__file__).resolve().parents[1] / "k8s"
RAY_VERSION = "2.60.0"  # tests check it equals the installed ray: the image must match what was tested
IMAGE = "specserve"  # built by k8s/Dockerfile FROM rayproject/ray:<RAY_VERSION>-py311[-gpu]
DRAFT_POOL, TARGET_POOL = "draft_pool", "target_pool"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
POD_LABELS = {"app.kubernetes.io/name": "specserve", "app.kubernetes.io/part-of": "specserve"}
SERVE_PORT, METRICS_PORT = 8000, 8080
MODEL_CACHE = "/mnt/specserve-models"  # where pods keep the models they fetch (args.*.download_dir)


@dataclass
class Pool:
    """A worker group: the pods of one model's replicas, one replica per pod."""

    name: str
    resource: str  # the custom resource only this group offers; its deployment asks for 1
    cpu: str
    memory: str
    gpus: int = 0
    min_pods: int = 1
    max_pods: int = 1
    node_selector: dict = field(default_factory=dict)
    shm: str | None = None  # /dev/shm size: NCCL between the ranks of one replica needs more than 64M


@dataclass
class Variant:
    """One RayService manifest: what it is for, the pods, and the Serve config overrides."""

    file: str
    name: str
    header: str
    draft: Pool
    target: Pool
    head_cpu: str = "2"
    head_memory: str = "8Gi"
    gpu: bool = False
    args: dict = field(default_factory=dict)  # deep-merged into the application's args
    deployments: dict = field(default_factory=dict)  # per-deployment options, deep-merged
    secrets: dict = field(default_factory=dict)  # env var -> (secret name, key, optional)
    annotations: dict = field(default_factory=dict)
    redis: bool = False  # GCS fault tolerance with an external Redis
    token_auth: bool = False  # Ray token auth for the dashboard, GCS and client ports
    model_cache_claim: str | None = None  # a PVC every pod mounts at MODEL_CACHE: fetched models, shared


def merge(base: dict, extra: dict) -> dict:
    """base with extra merged in, recursively for dicts; neither is modified."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def serve_config(v: Variant) -> dict:
    """cluster/serve_config.yaml with the variant's overrides: the dict embedded as serveConfigV2."""
    config = yaml.safe_load(CONFIG.read_text())
    config["http_options"]["host"] = "0.0.0.0"  # the serve Service reaches the proxies from other pods
    app = config["applications"][0]
    app["args"] = merge(app.get("args") or {}, v.args)
    for d in app["deployments"]:
        d.update(merge(d, v.deployments.get(d["name"], {})))
    return config


def image(v: Variant) -> str:
    return f"{IMAGE}:ray{RAY_VERSION}-py311{'-gpu' if v.gpu else ''}"


def env(v: Variant) -> list[dict]:
    """Serve's runtime profile and secrets by reference, the same on every Ray container (the ingress and build_app run anywhere)."""
    out = [{"name": var, "value": value} for var, value in SERVE_ENV.items()]
    for var, (secret, key, optional) in v.secrets.items():
        ref = {"name": secret, "key": key, **({"optional": True} if optional else {})}
        out.append({"name": var, "valueFrom": {"secretKeyRef": ref}})
    return out


def quantities(cpu: str, memory: str, gpus: int = 0) -> dict:
    """Requests equal to limits: Guaranteed QoS, and a GPU count the scheduler cannot round."""
    q = {"cpu": cpu, "memory": memory, **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    return {"requests": dict(q), "limits": dict(q)}


def container(v: Variant, name: str, resources: dict, ports: list[dict], mounts: list[dict]) -> dict:
    c = {"name": name, "image": image(v), "imagePullPolicy": "IfNotPresent", "resources": resources,
         "ports": ports}
    if env(v):
        c["env"] = env(v)
    if mounts:
        c["volumeMounts"] = mounts
    return c


def head(v: Variant) -> dict:
    """The head runs the Serve controller, proxies and autoscaler; `num-cpus: 0` keeps replicas off it."""
    ports = [{"containerPort": 6379, "name": "gcs-server"}, {"containerPort": 8265, "name": "dashboard"},
             {"containerPort": 10001, "name": "client"}, {"containerPort": SERVE_PORT, "name": "serve"},
             {"containerPort": METRICS_PORT, "name": "metrics"}]
    volumes, mounts = model_cache(v)
    spec = {"containers": [container(v, "ray-head", quantities(v.head_cpu, v.head_memory), ports, mounts)]}
    if volumes:
        spec["volumes"] = volumes
    return {"rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
            "template": {"metadata": {"labels": dict(POD_LABELS)}, "spec": spec}}


def model_cache(v: Variant) -> tuple[list[dict], list[dict]]:
    """The shared model cache's volume and mount: the builder and the ingress (any pod, the head
    included) read configs and tokenizers from it, the model replicas their weights."""
    if not v.model_cache_claim:
        return [], []
    return ([{"name": "model-cache", "persistentVolumeClaim": {"claimName": v.model_cache_claim}}],
            [{"name": "model-cache", "mountPath": MODEL_CACHE}])


def worker_group(v: Variant, pool: Pool) -> dict:
    """A worker group offering `pool.resource: 1` and `pool.gpus` GPUs per pod."""
    params = {"resources": '"' + json.dumps({pool.resource: 1}).replace('"', '\\"') + '"'}
    if pool.gpus:
        params = {"num-gpus": str(pool.gpus), **params}
    volumes, mounts = model_cache(v)
    if pool.shm:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": pool.shm}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    ports = [{"containerPort": SERVE_PORT, "name": "serve"}, {"containerPort": METRICS_PORT, "name": "metrics"}]
    spec = {"containers": [container(v, "ray-worker", quantities(pool.cpu, pool.memory, pool.gpus), ports, mounts)]}
    if pool.node_selector:
        spec["nodeSelector"] = dict(pool.node_selector)
    if pool.gpus:
        spec["tolerations"] = [dict(GPU_TOLERATION)]
    if volumes:
        spec["volumes"] = volumes
    return {"groupName": pool.name, "replicas": pool.min_pods, "minReplicas": pool.min_pods,
            "maxReplicas": pool.max_pods, "rayStartParams": params,
            "template": {"metadata": {"labels": dict(POD_LABELS)}, "spec": spec}}


def ray_service(v: Variant) -> dict:
    """The RayService of a variant, serveConfigV2 included."""
    cluster = {"rayVersion": RAY_VERSION, "enableInTreeAutoscaling": True,
               # GPU pods take minutes to come back: keep idle ones a while before scaling down
               "autoscalerOptions": {"idleTimeoutSeconds": 600 if v.gpu else 120, "upscalingMode": "Default"},
               "headGroupSpec": head(v),
               "workerGroupSpecs": [worker_group(v, v.draft), worker_group(v, v.target)]}
    if v.redis:
        cluster["gcsFaultToleranceOptions"] = {
            "redisAddress": "redis://specserve-redis:6379", "externalStorageNamespace": v.name,
            "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "specserve-redis", "key": "password"}}}}
    if v.token_auth:
        cluster["authOptions"] = {"mode": "token", "secretName": "specserve-ray-token"}
    meta = {"name": v.name, "labels": {"app.kubernetes.io/name": "specserve"}}
    if v.annotations:
        meta["annotations"] = dict(v.annotations)
    return {"apiVersion": "ray.io/v1", "kind": "RayService", "metadata": meta,
            "spec": {"upgradeStrategy": {"type": "NewCluster"},
                     "serveConfigV2": dump(serve_config(v)), "rayClusterConfig": cluster}}


class Literal(str):
    """A string dumped as a YAML literal block (serveConfigV2 stays readable)."""


yaml.SafeDumper.add_representer(
    Literal, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|"))


def dump(data: dict) -> Literal:
    return Literal(yaml.safe_dump(data, sort_keys=False, width=120))


def render(v: Variant) -> str:
    """The manifest file's text: the header comment, then the RayService."""
    header = "".join(f"# {line}".rstrip() + "\n" for line in v.header.strip().splitlines())
    note = ("# Generated by `python -m cluster.k8s` from cluster/serve_config.yaml: edit those and\n"
            "# regenerate; tests/test_k8s.py fails when this file and the generator disagree.\n")
    body = yaml.safe_dump(ray_service(v), sort_keys=False, width=120)
    return header + note + "---\n" + body


# object storage credentials (optional: pods may get them from their service account instead, IRSA or
# workload identity); AWS_ENDPOINT_URL in the same secret points boto3 at an S3-compatible server
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": ("specserve-s3", "access-key-id", True),
                  "AWS_SECRET_ACCESS_KEY": ("specserve-s3", "secret-access-key", True),
                  "AWS_ENDPOINT_URL": ("specserve-s3", "endpoint-url", True)}
API_KEY_OPTIONAL = {"SPECSERVE_API_KEY": ("specserve-api", "key", True)}
API_KEY = {"SPECSERVE_API_KEY": ("specserve-api", "key", False)}

DEV = Variant(
    file="ray-service.dev-cpu.yaml", name="specserve-dev",
    header="""
specserve dev cluster, CPU only: the reference pair (SmolLM2-135M-Instruct and its draft), built into the
image (k8s/Dockerfile, DEMO=1), on any Kubernetes (kind, minikube, a laptop). Needs ~9 CPUs and ~20 GiB for all pods at
their maximum; nothing else. The API key secret `specserve-api` is optional here (no key = no auth).
""",
    draft=Pool("draft", DRAFT_POOL, cpu="2", memory="4Gi", min_pods=1, max_pods=2),
    target=Pool("target", TARGET_POOL, cpu="2", memory="4Gi", min_pods=1, max_pods=2),
    head_cpu="1", head_memory="4Gi",
    deployments={"DraftServer": {"autoscaling_config": {"max_replicas": 2}}},
    secrets=API_KEY_OPTIONAL,
)

TP = 4  # GPUs per target replica: one pod, one STRICT_PACK placement group of TP one-GPU bundles
GPU_ARGS = {
    "speculation": {"verify_saturation_tokens": 512},  # a GPU verifies hundreds of tokens for the price of one
    # the KV cache of each takes what memory_utilization leaves after weights and working buffers (no
    # byte cap: the CPU config's 1 GiB would hold ~13k tokens of the 70B target per rank). Each must
    # hold one sequence of max_model_len or its replica refuses to start; `specserve plan` on this
    # manifest: ~470k tokens per target rank, ~490k on the draft's L4 (k8s/README.md)
    # from object storage, fetched once into the shared cache (app/model/sources.py): a new pod of a node that
    # already has it loads at once, where a per-pod download took the 140 GB again
    "target": {"model": "s3://specserve-models/meta-llama/Llama-3.1-70B-Instruct", "download_dir": MODEL_CACHE,
               "dtype": "bfloat16", "tensor_parallel_size": TP,
               "memory_utilization": 0.9, "rank_resources": {"GPU": 1, "CPU": 4}, "replica_cpus": 1,
               "max_cache_bytes": None, "max_model_len": 131072},
    "draft": {"model": "s3://specserve-models/meta-llama/Llama-3.2-1B-Instruct", "download_dir": MODEL_CACHE,
              "dtype": "bfloat16", "memory_utilization": 0.9,
              "max_cache_bytes": None, "max_model_len": 131072, "packed_weights": "model"},  # packing: CPU only
}
GPU_DEPLOYMENTS = {
    "DraftServer": {"autoscaling_config": {"max_replicas": 8},
                    "ray_actor_options": {"num_cpus": 1, "num_gpus": 1}},
    # no num_gpus: the replica's rank workers hold its GPUs, in the placement group it reserves
    "TargetServer": {"autoscaling_config": {"max_replicas": 4}, "ray_actor_options": {"num_cpus": 1}},
}
GPU_HEADER = """
Needs: KubeRay >= 1.5, node pools labelled by nvidia.com/gpu.product (GPU feature discovery) and
tainted nvidia.com/gpu:NoSchedule, the image built by k8s/Dockerfile, the models in the bucket
`specserve-models` (each model's files under its name; `aws s3 sync` from a Hugging Face snapshot),
the PVC `specserve-models` (k8s/model-cache.yaml: ReadWriteMany, where pods keep what they fetch),
the secret `specserve-api` (key `key`), and S3 credentials: the secret `specserve-s3` (keys
`access-key-id`, `secret-access-key`, optional `endpoint-url` for an S3-compatible server) or the
pods' service account (IRSA).
Draft pool: 1 x L4 per pod, Llama-3.2-1B. Target pool: 4 x H100 80GB per pod, Llama-3.1-70B in
tensor parallel over the 4 GPUs of one pod. Each pool scales with its own deployment (1-8, 1-4).
"""


def gpu_variant(file: str, name: str, purpose: str, **kw) -> Variant:
    """The production GPU shape; HA and auth variants add to it."""
    return Variant(
        file=file, name=name, header=purpose.strip() + "\n" + GPU_HEADER, gpu=True,
        draft=Pool("draft-gpu", DRAFT_POOL, cpu="8", memory="32Gi", gpus=1, min_pods=1, max_pods=8,
                   node_selector={"nvidia.com/gpu.product": "NVIDIA-L4"}),
        target=Pool("target-gpu", TARGET_POOL, cpu="32", memory="384Gi", gpus=TP, min_pods=1, max_pods=4,
                    node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                    shm="64Gi"),
        head_cpu="8", head_memory="32Gi", args=GPU_ARGS, deployments=kw.pop("deployments", GPU_DEPLOYMENTS),
        secrets={**S3_CREDENTIALS, **API_KEY}, model_cache_claim="specserve-models",
        # a 70B download and load can outlast the default wait for the first healthy app
        annotations={"ray.io/initializing-timeout": "45m"}, **kw)


GPU = gpu_variant("ray-service.gpu.yaml", "specserve", "specserve in production on GPUs.")
HA_DEPLOYMENTS = merge(GPU_DEPLOYMENTS, {
    "Ingress": {"num_replicas": 2, "max_replicas_per_node": 1},
})
HA = gpu_variant(
    "ray-service.ha.yaml", "specserve-ha",
    """specserve in production on GPUs, highly available: GCS fault tolerance with an external Redis
(Service `specserve-redis:6379`, password in secret `specserve-redis`, key `password`), so a
head pod restart does not take the Serve replicas down; the Ingress on two pods.""",
    redis=True, deployments=HA_DEPLOYMENTS)
AUTH = gpu_variant(
    "ray-service.auth.yaml", "specserve-auth",
    """specserve in production on GPUs with Ray token auth (Ray >= 2.52, KubeRay >= 1.5.1): the
dashboard, GCS and client ports ask for the token in secret `specserve-ray-token` (key
`auth_token`). The Serve endpoint is guarded by the application's own API key, as elsewhere.""",
    token_auth=True)

VARIANTS = [DEV, GPU, HA, AUTH]


def outputs() -> dict[str, str]:
    """Every generated file: name under k8s/ -> text."""
    files = {v.file: render(v) for v in VARIANTS}
    files["grafana-dashboard.json"] = json.dumps(dashboard(), indent=2) + "\n"
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.k8s", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with k8s/ instead of writing")
    p.add_argument("--out", type=Path, default=OUT, help="where to write (default: k8s/)")
    args = p.parse_args(argv)
    stale = []
    for name, text in outputs().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"out of date (run python -m cluster.k8s): {', '.join(stale)}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
