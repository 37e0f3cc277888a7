"""The Serve application builder of the shipped configs: `args` as deployments.application.build_app
takes them, the models they leave unnamed filled in from the built pair `args.pair` (specserve.demo.models:
built on first use, cached after). The serving layer itself takes model paths and never imports the
pair builder; a config that names its models can use either builder."""

import copy

from ray.serve import Application


def with_pair(args: dict | None) -> dict:
    """`args` with the unnamed models of the built pair `args.pair` filled in."""
    from deployments.args import AppConfig
    from specserve.demo import models

    args = copy.deepcopy(args or {})
    cfg = AppConfig.model_validate(args)
    speculating = cfg.draft is not None
    target, draft = models(cfg.target.model, cfg.draft.model if speculating else None, cfg.pair,
                           with_draft=speculating)
    args["target"] = {**(args.get("target") or {}), "model": target}
    if draft is not None:
        args["draft"] = {**(args.get("draft") or {}), "model": draft}
    return args


def build_app(args: dict | None = None) -> Application:
    """The specserve application (deployments.application.build_app) over the models `with_pair` names."""
    from deployments.application import build_app as build

    return build(with_pair(args))
