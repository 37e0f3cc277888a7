"""Ray Serve deployments over the engine: DraftServer, TargetServer, Router, Ingress and build_app."""
