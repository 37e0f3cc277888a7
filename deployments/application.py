"""build_app: the Serve application (Ingress -> TargetServer -> DraftServer) from typed args.

Deployment options here are defaults; the Serve config's `deployments:` entries override them
(replicas, autoscaling_config, ray_actor_options, max_ongoing_requests, health checks).
"""

from pathlib import Path

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from transformers import AutoConfig, AutoTokenizer

from app.speculation.pairing import check_vocabularies
from app.model.sources import local_model
from deployments.affinity import ChoiceGroupRouter, SessionAffinityRouter
from deployments.args import AppConfig
from deployments.ingress import Ingress
from deployments.servers import DraftServer, TargetServer


def model_paths(cfg: AppConfig) -> tuple[str, str | None]:
    """The target's and the draft's sources as the config names them (no draft: plain decoding)."""
    if cfg.target.model is None:
        raise ValueError("args.target.model names no model: give a directory, hub id, s3:// or gs:// source, or "
                         "deploy with import_path specserve.serving:build_app, which serves the built pair args.pair")
    return cfg.target.model, cfg.draft.model if cfg.draft else None


def tensor_parallel_options(cfg: AppConfig) -> dict:
    """Placement group of a tensor-parallel TargetServer replica: N bundles on one node (STRICT_PACK).

    Bundle 0 also holds the replica itself (its ray_actor_options must fit: `replica_cpus` CPUs and
    one unit of the target pool's resource); bundle i holds rank worker i.
    """
    n = cfg.target.tensor_parallel_size
    if n == 1:
        return {}
    rank = dict(cfg.target.rank_resources)
    first = {**rank, "CPU": rank.get("CPU", 0) + cfg.target.replica_cpus}
    if cfg.target.pool_resource:
        first[cfg.target.pool_resource] = 1
    return {"placement_group_bundles": [first] + [rank] * (n - 1), "placement_group_strategy": "STRICT_PACK"}


def build_app(args: dict) -> Application:
    """The specserve application; `args` is AppConfig (the `args` of cluster/serve_config.yaml)."""
    cfg = AppConfig.model_validate(args or {})
    target_path, draft_path = model_paths(cfg)  # sources: each replica makes them local on its own node
    # the builder reads configs and tokenizers only: a remote model's other files, fetched on this node
    target_meta = local_model(target_path, cfg.target.revision, cfg.target.download_dir, weights=False)
    if draft_path:
        draft_meta = local_model(draft_path, cfg.draft.revision, cfg.draft.download_dir, weights=False)
        # refused here, before any replica starts, not by every batch once the app takes traffic
        check_vocabularies(
            AutoTokenizer.from_pretrained(target_meta, trust_remote_code=cfg.target.trust_remote_code),
            AutoTokenizer.from_pretrained(draft_meta, trust_remote_code=cfg.draft.trust_remote_code))
    max_context = getattr(AutoConfig.from_pretrained(target_meta), "max_position_embeddings", None) or 1 << 30
    max_context = min(max_context, cfg.target.max_model_len or max_context)
    name = cfg.served_model_name or Path(target_path.rstrip("/")).name
    affinity = RequestRouterConfig(request_router_class=SessionAffinityRouter)

    draft = None
    if draft_path:
        draft = serve.deployment(
            DraftServer, name="DraftServer", max_ongoing_requests=64, ray_actor_options={"num_cpus": 0.25},
            request_router_config=affinity, health_check_period_s=5, health_check_timeout_s=30,
        ).bind(cfg.draft, draft_path, cfg.draft_batch, cfg.speculation.draft_top_n)
    # one call per request, placed by Serve's power of two choices; a prompt's n choices on one replica
    target = serve.deployment(
        TargetServer, name="TargetServer", max_ongoing_requests=128, ray_actor_options={"num_cpus": 0.25},
        request_router_config=RequestRouterConfig(request_router_class=ChoiceGroupRouter),
        health_check_period_s=5, health_check_timeout_s=30, **tensor_parallel_options(cfg),
    ).bind(cfg.target, target_path, cfg.target_batch, draft, cfg.speculation, max_context)
    ingress = serve.deployment(
        Ingress, name="Ingress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0.1},
    ).bind(target, cfg, target_path, name, max_context)
    return ingress
