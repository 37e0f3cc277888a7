"""`specserve plan FILE`: will each model replica of a Serve config or RayService manifest fit its device?

Per deployment (the draft server, the target server: per tensor-parallel rank), from the model's
config.json on the meta device (no weights, no GPU, no network): the device's memory, the weights
per rank, the working buffers of its largest forward (app/model/memory.py, the formula a replica sizes
its KV cache with), the KV bytes and tokens that leaves at memory_utilization, max_model_len, and
whether one sequence of max_model_len fits. Exits 1 when any does not.

Configs come from a local model directory, or from cluster/model_configs/ for the models the
shipped manifests name (configs only, written from the models' published config.json). The GPU is
the worker group's `nvidia.com/gpu.product` node selector in a manifest, or `--gpu NAME=PRODUCT`.
"""

import argparse
import fnmatch
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

from app.model.memory import CPU_DEFAULT_BYTES, DRAFT_PREFILL_TOKENS, ForwardSize, kv_bytes_per_token, working_bytes
from app.model.runner import auto_attention

MiB, GiB = 1 << 20, 1 << 30
CONFIGS = Path(__file__).resolve().parents[1] / "cluster" / "model_configs"
# device memory as nvidia-smi reports its total; H100 and H200 seen on machines lent here, the others
# from their published sizes
GPU_BYTES = {
    "NVIDIA-H100-80GB-HBM3": 81559 * MiB,
    "NVIDIA-H200": 143771 * MiB,
    "NVIDIA-A100-SXM4-80GB": 81920 * MiB,
    "NVIDIA-L4": 23034 * MiB,
    "NVIDIA-A10G": 23028 * MiB,
}
# memory in use on a GPU before the weights: torch's CUDA context, cuBLAS workspaces, NCCL buffers (an allowance)
RUNTIME_BYTES = GiB
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": torch.bfloat16}


@dataclass
class Row:
    name: str
    gpu: str | None
    gpu_bytes: int
    weights_bytes: int
    working_bytes: int
    kv_bytes: int
    kv_tokens: int
    max_model_len: int
    tensor_parallel_size: int
    fits: bool
    model_config: dict
    why: str = ""


def shipped_name(model: str) -> str:
    """The name cluster/model_configs/ keeps a model's config under: a hub id as it is, an object-storage
    source by its path in the bucket (s3://specserve-models/meta-llama/X: meta-llama/X)."""
    return model.partition("://")[2].partition("/")[2] if "://" in model else model


def model_config(model: str | None, pair_role: str) -> dict:
    """The config.json of a model id or directory; None is the reference pair's model."""
    if model is None:
        path = (CONFIGS / "smollm2" / "target" if pair_role == "target"
                else Path(__file__).resolve().parent / "demo" / "weights" / "smollm2-draft")
    elif (Path(model) / "config.json").exists():
        path = Path(model)
    elif (CONFIGS / shipped_name(model) / "config.json").exists():
        path = CONFIGS / shipped_name(model)
    else:
        raise SystemExit(f"plan: no config.json for {model!r}: give a local model directory, or add its config "
                         f"under {CONFIGS}")
    return json.loads((path / "config.json").read_text())


def weights_per_rank(config: dict, dtype: torch.dtype, tp: int) -> int:
    """Bytes of one rank's weights: the model built on the meta device, the parameters its
    tensor-parallel plan shards divided by tp, the rest whole on every rank."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    plan = getattr(model, "_tp_plan", None) or {}
    itemsize = torch.finfo(dtype).bits // 8
    total = 0
    for name, p in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        sharded = tp > 1 and any(fnmatch.fnmatchcase(module, pattern) for pattern in plan)
        total += p.numel() * itemsize // (tp if sharded else 1)
    return total


def plan_model(name: str, settings, config: dict, gpu: str | None, forward_tokens: int, logit_rows: int,
               batch: int) -> Row:
    """One replica (one rank of it) against its device."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(**config)
    dtype = DTYPES[settings.dtype]
    tp = getattr(settings, "tensor_parallel_size", 1)
    positions = getattr(cfg, "max_position_embeddings", None) or 1 << 30
    weights = weights_per_rank(config, dtype, tp)
    attention = ("padded" if getattr(cfg, "sliding_window", None) or getattr(cfg, "attn_logit_softcapping", None)
                 else settings.attention if settings.attention != "auto"
                 else auto_attention(dtype, "cuda" if gpu else "cpu", dtype in (torch.float32, torch.bfloat16)))
    max_len = settings.max_model_len or positions
    work = working_bytes(cfg, dtype, cfg.vocab_size, ForwardSize(forward_tokens, max_len, logit_rows, batch),
                         attention=attention, tp_size=tp, device_type="cuda" if gpu else "cpu")
    per_token = kv_bytes_per_token(cfg, dtype, tp)
    if gpu is None:  # a CPU replica: the byte cap alone (app/model/memory.py)
        total, kv = 0, settings.max_cache_bytes or CPU_DEFAULT_BYTES
    else:
        if gpu not in GPU_BYTES:
            raise SystemExit(f"plan: unknown GPU {gpu!r}: one of {', '.join(GPU_BYTES)}")
        total = GPU_BYTES[gpu]
        kv = int(settings.memory_utilization * total) - RUNTIME_BYTES - weights - work
        kv = kv if settings.max_cache_bytes is None else min(kv, settings.max_cache_bytes)
    tokens = max(0, kv) // per_token if per_token else 0
    # an explicit max_model_len must fit; the default one is lowered to what the KV cache holds
    if settings.max_model_len is None:
        max_len = min(positions, tokens)
    fits = kv > 0 and tokens >= max_len
    why = "" if fits else (f"nothing left for the KV cache at memory_utilization {settings.memory_utilization}"
                           if kv <= 0 else f"KV holds {tokens} tokens < max_model_len {max_len}")
    return Row(name, gpu, total, weights, work, max(0, kv), tokens, max_len, tp, fits, config, why)


def plan_app(args: dict, gpus: dict[str, str | None]) -> list[Row]:
    """Rows for the application's DraftServer (when it has a draft) and TargetServer."""
    from deployments.args import AppConfig

    cfg = AppConfig.model_validate(args)
    target_rows = cfg.target_batch.max_batch_size * (cfg.speculation.k_max + 2)  # as deployments/servers.py
    rows = []
    if cfg.draft is not None and (cfg.draft.model is not None or cfg.target.model is None):
        batch = cfg.draft_batch.max_batch_size
        rows.append(plan_model("DraftServer", cfg.draft, model_config(cfg.draft.model, "draft"),
                               gpus.get("DraftServer"), max(batch, DRAFT_PREFILL_TOKENS), batch, batch))
    rows.append(plan_model("TargetServer", cfg.target, model_config(cfg.target.model, "target"),
                           gpus.get("TargetServer"), cfg.target_batch.max_batch_tokens,
                           target_rows, cfg.target_batch.max_batch_size))
    return rows


def _manifest_gpus(rs: dict, serve: dict) -> dict[str, str | None]:
    """Each deployment's GPU product: the worker group offering the custom resource it asks for."""
    groups = rs["spec"]["rayClusterConfig"].get("workerGroupSpecs", [])
    offered = {}
    for g in groups:
        resources = json.loads(json.loads(g.get("rayStartParams", {}).get("resources", '"{}"')))
        gpu = (g["template"]["spec"].get("nodeSelector") or {}).get("nvidia.com/gpu.product")
        has_gpu = int(str(g.get("rayStartParams", {}).get("num-gpus", "0")).strip("'\"") or 0) > 0
        for r in resources:
            offered[r] = gpu if has_gpu else None
    out = {}
    for d in serve["applications"][0].get("deployments", []):
        wanted = (d.get("ray_actor_options") or {}).get("resources") or {}
        out[d["name"]] = next((offered[r] for r in wanted if r in offered), None)
    return out


def plan_file(path: str, gpus: dict[str, str] | None = None) -> list[Row]:
    doc = yaml.safe_load(Path(path).read_text())
    if doc.get("kind") == "RayService":
        serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
        found = _manifest_gpus(doc, serve)
    else:
        serve, found = doc, {}
    return plan_app(serve["applications"][0].get("args") or {}, {**found, **(gpus or {})})


def table(rows: list[Row]) -> str:
    head = ("deployment", "GPU", "memory", "weights/rank", "working", "KV", "KV tokens", "max_model_len", "TP", "fits")
    lines = [head]
    for r in rows:
        lines.append((r.name, r.gpu or "cpu", f"{r.gpu_bytes / GiB:.1f} GiB" if r.gpu else "-",
                      f"{r.weights_bytes / GiB:.2f} GiB", f"{r.working_bytes / GiB:.2f} GiB", f"{r.kv_bytes / GiB:.2f} GiB",
                      f"{r.kv_tokens:,}", f"{r.max_model_len:,}", str(r.tensor_parallel_size),
                      "yes" if r.fits else f"NO: {r.why}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


KEYS = ("name", "gpu_bytes", "weights_bytes", "working_bytes", "kv_bytes", "kv_tokens", "max_model_len",
        "tensor_parallel_size", "fits", "model_config")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a Serve config (cluster/serve_config.yaml) or a RayService manifest (k8s/*.yaml)")
    p.add_argument("--gpu", action="append", default=[], metavar="DEPLOYMENT=PRODUCT",
                   help=f"a deployment's GPU where the file does not say (products: {', '.join(GPU_BYTES)})")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per deployment")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specserve plan", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    gpus = dict(g.split("=", 1) for g in args.gpu)
    rows = plan_file(args.file, gpus)
    if args.json:
        print(json.dumps([{k: asdict(r)[k] for k in KEYS} for r in rows], indent=2))
    else:
        print(table(rows))
    return 0 if all(r.fits for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
