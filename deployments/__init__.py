"""Ray Serve deployments over the engine: DraftServer, TargetServer, Ingress (with its Dispatcher) and build_app."""
