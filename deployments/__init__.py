"""Ray Serve deployments over the engine: DraftServer, TargetServer, Ingress (with its Router) and build_app."""
